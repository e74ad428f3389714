//! The budgeted device: the CPU standing in for a GPU. Every device allocation is taken from the
//! ledger's HBM budget (refused past it) and every host→device and device→host copy is counted,
//! so the offload policies run in CI with exact byte accounting. Weights uploaded here are real
//! copies, as on a GPU. The math is the CPU backend's.

use std::sync::Arc;

use super::cpu::{CpuBackend, CpuTensor};
use super::{Act, AttnShape, Backend, BackendError, BundleShape, Result, RopePairs};
use crate::tensor::{Bytes, DType, HostTensor};
use crate::tier::ledger::{Ledger, Reservation, Tier};

pub struct SimBackend {
    cpu: CpuBackend,
    ledger: Arc<Ledger>,
}

/// Activations in the budgeted device's memory.
pub struct SimTensor {
    t: CpuTensor,
    _hold: Reservation,
}

/// A weight in the budgeted device's memory.
pub struct SimWeight {
    w: HostTensor,
    _hold: Reservation,
}

impl SimBackend {
    pub fn new(cpu: CpuBackend, ledger: Arc<Ledger>) -> Self {
        SimBackend { cpu, ledger }
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    fn reserve(&self, bytes: usize, what: &str) -> Result<Reservation> {
        self.ledger
            .reserve(Tier::Hbm, bytes as u64, what)
            .map_err(|e| BackendError::OutOfMemory {
                what: e.what,
                needed: e.needed as usize,
                available: e.available as usize,
            })
    }
}

impl Backend for SimBackend {
    type Tensor = SimTensor;
    type Weight = SimWeight;
    type Event = ();

    fn name(&self) -> String {
        let budget = self
            .ledger
            .hbm_budget()
            .map_or("unlimited".to_string(), |b| format!("{} MiB", b >> 20));
        format!("sim (budgeted device, {budget}) on {}", self.cpu.name())
    }

    fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.cpu.enter(f)
    }

    fn upload(&self, w: &HostTensor) -> Result<SimWeight> {
        let hold = self.reserve(w.data.len(), &w.name)?;
        self.ledger.count_h2d(w.data.len() as u64);
        Ok(SimWeight {
            w: HostTensor {
                data: Bytes::from_slice(w.data.as_slice()),
                ..w.clone()
            },
            _hold: hold,
        })
    }

    fn alloc_weight(
        &self,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<SimWeight> {
        let bytes = rows.saturating_mul(dtype.bytes_for(cols));
        let hold = self.reserve(bytes, name)?;
        Ok(SimWeight {
            w: self.cpu.alloc_weight(name, dtype, rows, cols)?,
            _hold: hold,
        })
    }

    fn upload_into(&self, dst: &mut SimWeight, first_row: usize, src: &[u8]) -> Result<()> {
        self.cpu.upload_into(&mut dst.w, first_row, src)?;
        self.ledger.count_h2d(src.len() as u64);
        Ok(())
    }

    fn copies_done(&self) -> Result<()> {
        Ok(())
    }

    fn compute_done(&self) -> Result<()> {
        Ok(())
    }

    fn compute_waits(&self, _: &()) -> Result<()> {
        Ok(())
    }

    fn copies_wait(&self, _: &()) -> Result<()> {
        Ok(())
    }

    fn host_waits(&self, _: &()) -> Result<()> {
        Ok(())
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<SimTensor> {
        let bytes = rows.saturating_mul(cols).saturating_mul(4);
        let hold = self.reserve(bytes, &format!("a {rows}x{cols} activation buffer"))?;
        Ok(SimTensor {
            t: self.cpu.alloc(rows, cols)?,
            _hold: hold,
        })
    }

    fn write(&self, dst: &mut SimTensor, src: &[f32]) -> Result<()> {
        self.cpu.write(&mut dst.t, src)?;
        self.ledger.count_h2d(std::mem::size_of_val(src) as u64);
        Ok(())
    }

    fn read(&self, src: &SimTensor, dst: &mut [f32]) -> Result<()> {
        self.cpu.read(&src.t, dst)?;
        self.ledger.count_d2h(std::mem::size_of_val(dst) as u64);
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &SimTensor,
        src_row: usize,
        dst: &mut SimTensor,
        dst_row: usize,
        n: usize,
    ) -> Result<()> {
        self.cpu.copy_rows(&src.t, src_row, &mut dst.t, dst_row, n)
    }

    fn shape(&self, t: &SimTensor) -> (usize, usize) {
        self.cpu.shape(&t.t)
    }

    fn embed(&self, table: &SimWeight, ids: &[u32], out: &mut SimTensor) -> Result<()> {
        self.cpu.embed(&table.w, ids, &mut out.t)
    }

    fn add_table_rows(&self, x: &mut SimTensor, table: &SimWeight, first_row: usize) -> Result<()> {
        self.cpu.add_table_rows(&mut x.t, &table.w, first_row)
    }

    fn matmul_into(
        &self,
        w: &SimWeight,
        x: &SimTensor,
        out: &mut SimTensor,
        col0: usize,
    ) -> Result<()> {
        self.cpu.matmul_into(&w.w, &x.t, &mut out.t, col0)
    }

    fn ffn_bundles_up(
        &self,
        b: &SimWeight,
        shape: BundleShape,
        x: &SimTensor,
        act: Act,
        up_bias: Option<&SimWeight>,
        h: &mut SimTensor,
        col0: usize,
    ) -> Result<()> {
        self.cpu.ffn_bundles_up(
            &b.w,
            shape,
            &x.t,
            act,
            up_bias.map(|w| &w.w),
            &mut h.t,
            col0,
        )
    }

    fn ffn_bundles_down(
        &self,
        b: &SimWeight,
        shape: BundleShape,
        h: &SimTensor,
        col0: usize,
        out: &mut SimTensor,
    ) -> Result<()> {
        self.cpu
            .ffn_bundles_down(&b.w, shape, &h.t, col0, &mut out.t)
    }

    fn zero(&self, x: &mut SimTensor) -> Result<()> {
        self.cpu.zero(&mut x.t)
    }

    fn add_bias(&self, x: &mut SimTensor, bias: &SimWeight) -> Result<()> {
        self.cpu.add_bias(&mut x.t, &bias.w)
    }

    fn add(&self, x: &mut SimTensor, y: &SimTensor) -> Result<()> {
        self.cpu.add(&mut x.t, &y.t)
    }

    fn rms_norm(&self, x: &SimTensor, w: &SimWeight, eps: f32, out: &mut SimTensor) -> Result<()> {
        self.cpu.rms_norm(&x.t, &w.w, eps, &mut out.t)
    }

    fn layer_norm(
        &self,
        x: &SimTensor,
        w: &SimWeight,
        b: &SimWeight,
        eps: f32,
        out: &mut SimTensor,
    ) -> Result<()> {
        self.cpu.layer_norm(&x.t, &w.w, &b.w, eps, &mut out.t)
    }

    fn rope(
        &self,
        x: &mut SimTensor,
        head_dim: usize,
        rot_dims: usize,
        pairs: RopePairs,
        inv_freq: &SimWeight,
        first_pos: usize,
    ) -> Result<()> {
        self.cpu
            .rope(&mut x.t, head_dim, rot_dims, pairs, &inv_freq.w, first_pos)
    }

    fn activate(&self, x: &mut SimTensor, act: Act) -> Result<()> {
        self.cpu.activate(&mut x.t, act)
    }

    fn gated(&self, gate: &mut SimTensor, up: &SimTensor, act: Act) -> Result<()> {
        self.cpu.gated(&mut gate.t, &up.t, act)
    }

    fn attention(
        &self,
        q: &SimTensor,
        k_cache: &SimTensor,
        v_cache: &SimTensor,
        first_pos: usize,
        shape: AttnShape,
        out: &mut SimTensor,
    ) -> Result<()> {
        self.cpu
            .attention(&q.t, &k_cache.t, &v_cache.t, first_pos, shape, &mut out.t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_memory_is_budgeted_and_copies_counted() {
        let ledger = Ledger::new(Some(1000), None);
        let sim = SimBackend::new(CpuBackend::new(1).unwrap(), ledger.clone());
        let w = HostTensor::from_f32("w", 10, 10, vec![1.0; 100]);
        let dw = sim.upload(&w).unwrap(); // 400 bytes
        let mut t = sim.alloc(2, 50).unwrap(); // 400 bytes
        assert!(matches!(
            sim.alloc(2, 50),
            Err(BackendError::OutOfMemory { .. })
        ));
        sim.write(&mut t, &[0.5; 100]).unwrap();
        let mut back = vec![0f32; 100];
        sim.read(&t, &mut back).unwrap();
        let s = ledger.snapshot();
        assert_eq!((s.hbm_used, s.h2d_bytes, s.d2h_bytes), (800, 800, 400));
        drop((dw, t));
        assert_eq!(ledger.snapshot().hbm_used, 0);
        assert_eq!(ledger.snapshot().hbm_peak, 800);
    }
}
