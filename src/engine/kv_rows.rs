//! A session's cache rows read and written wherever they live (the device, host memory, the
//! pool's blocks), as f32 or as the cache's own bytes; and, per layer, a host-kept session's rows
//! copied into the device work buffers before the layer runs and back after.

use super::kv_pool::lock_pool;
use super::session::{Session, SessionKv};
use super::{Engine, EngineError, Result};
use crate::backend::{Backend, KV_BLOCK, kv_runs};

impl<B: Backend> Engine<B> {
    /// Keys and values of positions `first..first + len` of every layer, laid out per layer K
    /// then V, each `len × kv_dim` (the layout of `kv::ChunkData`).
    pub fn read_kv(&self, s: &mut Session<B>, first: usize, len: usize) -> Result<Vec<f32>> {
        let raw = self.read_kv_raw(s, first, len)?;
        let kv = self.spec.kv_dim();
        let mut out = vec![0f32; 2 * self.spec.n_layers * len * kv];
        crate::backend::cpu::decode_rows(self.kv_type, &raw, kv, &mut out);
        Ok(out)
    }

    /// [`Engine::read_kv`] as the cache holds it: rows of [`Engine::kv_type`] bytes, no
    /// conversion (per layer K then V, each `len` rows).
    pub fn read_kv_raw(&self, s: &mut Session<B>, first: usize, len: usize) -> Result<Vec<u8>> {
        self.check_rows(s, first, len)?;
        let part = len * self.kv_type.row_bytes(self.spec.kv_dim());
        let mut out = vec![0u8; 2 * self.spec.n_layers * part];
        if len == 0 {
            return Ok(out);
        }
        // Straight from the caches to the host: no device temporary.
        for (i, p) in out.chunks_mut(part).enumerate() {
            self.read_kv_raw_rows(s, i / 2, i % 2 == 1, first, p)?;
        }
        Ok(out)
    }

    /// Rows `first..` of layer `l`'s keys (or values) as f32, wherever the session keeps them.
    pub(super) fn read_kv_rows(
        &self,
        s: &Session<B>,
        l: usize,
        values: bool,
        first: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let cols = self.spec.kv_dim();
        let rows = out.len() / cols.max(1);
        let mut raw = vec![0u8; rows * self.kv_type.row_bytes(cols)];
        self.read_kv_raw_rows(s, l, values, first, &mut raw)?;
        crate::backend::cpu::decode_rows(self.kv_type, &raw, cols, out);
        Ok(())
    }

    /// Rows `first..` of layer `l`'s keys (or values) as the cache's bytes (`out.len()` bytes
    /// of whole rows), wherever the session keeps them.
    fn read_kv_raw_rows(
        &self,
        s: &Session<B>,
        l: usize,
        values: bool,
        first: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let rb = self.kv_type.row_bytes(self.spec.kv_dim());
        let rows = out.len() / rb.max(1);
        match &s.kv {
            SessionKv::Device { k, v } => {
                let src = if values { &v[l] } else { &k[l] };
                self.backend.read_kv_raw(src, first, out)?;
            }
            SessionKv::Host(h) => {
                let raw = if values { &h.v[l] } else { &h.k[l] };
                let range = first * h.row_bytes..(first + rows) * h.row_bytes;
                let bytes = raw.bytes().get(range).ok_or(EngineError::ContextFull {
                    needed: first + rows,
                    ctx: s.ctx,
                })?;
                out.copy_from_slice(bytes);
            }
            SessionKv::Paged(p) => {
                if (first + rows).div_ceil(KV_BLOCK) > p.blocks.len() {
                    return Err(EngineError::Weights(format!(
                        "KV rows {first}..{} of a session holding {} blocks",
                        first + rows,
                        p.blocks.len()
                    )));
                }
                let pool = lock_pool(&p.pool);
                let src = if values { &pool.v[l] } else { &pool.k[l] };
                for (off, row, n) in kv_runs(Some(&p.blocks), first, rows) {
                    self.backend
                        .read_kv_raw(src, row, &mut out[off * rb..(off + n) * rb])?;
                }
            }
        }
        Ok(())
    }

    /// Write keys and values (layout of [`Engine::read_kv`]) into positions `first..first + len`.
    /// The session's position is not changed: see [`Session::set_position`].
    pub fn write_kv(
        &self,
        s: &mut Session<B>,
        first: usize,
        len: usize,
        values: &[f32],
    ) -> Result<()> {
        let kv = self.spec.kv_dim();
        if values.len() != 2 * self.spec.n_layers * len * kv {
            return Err(EngineError::Weights(format!(
                "KV rows: {} values given for {len} positions",
                values.len()
            )));
        }
        let raw = crate::backend::cpu::encode_rows(self.kv_type, values, kv);
        self.write_kv_raw(s, first, len, &raw)
    }

    /// [`Engine::write_kv`] from the cache's own bytes (layout of [`Engine::read_kv_raw`]).
    pub fn write_kv_raw(
        &self,
        s: &mut Session<B>,
        first: usize,
        len: usize,
        bytes: &[u8],
    ) -> Result<()> {
        self.check_rows(s, first, len)?;
        let rb = self.kv_type.row_bytes(self.spec.kv_dim());
        if bytes.len() != 2 * self.spec.n_layers * len * rb {
            return Err(EngineError::Weights(format!(
                "KV rows: {} bytes given for {len} positions of {rb}-byte rows",
                bytes.len()
            )));
        }
        if len == 0 {
            return Ok(());
        }
        self.take_blocks(&mut [(&mut *s, first + len)])?;
        for (i, part) in bytes.chunks(len * rb).enumerate() {
            let (l, is_v) = (i / 2, i % 2 == 1);
            match &mut s.kv {
                SessionKv::Device { k, v } => {
                    let dst = if is_v { &mut v[l] } else { &mut k[l] };
                    self.backend.write_kv_raw(dst, first, part)?;
                }
                SessionKv::Host(h) => {
                    let raw = if is_v { &mut h.v[l] } else { &mut h.k[l] };
                    raw.bytes_mut()[first * rb..(first + len) * rb].copy_from_slice(part);
                }
                SessionKv::Paged(p) => {
                    let mut pool = lock_pool(&p.pool);
                    let dst = if is_v { &mut pool.v[l] } else { &mut pool.k[l] };
                    for (off, row, n) in kv_runs(Some(&p.blocks), first, len) {
                        self.backend
                            .write_kv_raw(dst, row, &part[off * rb..(off + n) * rb])?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Before layer `l` runs steps from position `pos`: a host-kept session's rows `0..pos` of
    /// that layer into the device work buffers.
    pub(super) fn kv_layer_begin(
        &self,
        s: &mut Session<B>,
        l: usize,
        pos: usize,
        on_cpu: bool,
    ) -> Result<()> {
        if on_cpu {
            return Ok(());
        }
        if let SessionKv::Host(h) = &mut s.kv {
            let end = pos * h.row_bytes;
            for (raw, work) in [(&h.k[l], &mut h.work_k), (&h.v[l], &mut h.work_v)] {
                self.backend.write_kv_raw(work, 0, &raw.bytes()[..end])?;
            }
        }
        Ok(())
    }

    /// After layer `l` has stored rows `pos..pos + n`: a host-kept session's copies of them.
    pub(super) fn kv_layer_end(
        &self,
        s: &mut Session<B>,
        l: usize,
        pos: usize,
        n: usize,
        on_cpu: bool,
    ) -> Result<()> {
        if on_cpu {
            return Ok(());
        }
        if let SessionKv::Host(h) = &mut s.kv {
            let rb = h.row_bytes;
            for (raw, work) in [(&mut h.k[l], &h.work_k), (&mut h.v[l], &h.work_v)] {
                let rows = &mut raw.bytes_mut()[pos * rb..(pos + n) * rb];
                self.backend.read_kv_raw(work, pos, rows)?;
            }
        }
        Ok(())
    }

    fn check_rows(&self, s: &Session<B>, first: usize, len: usize) -> Result<()> {
        if first + len > s.ctx {
            return Err(EngineError::ContextFull {
                needed: first + len,
                ctx: s.ctx,
            });
        }
        Ok(())
    }
}
