//! The rules of recorded steps, one definition for CUDA and the budgeted device alike (the
//! budgeted device exists to refuse in CI what CUDA must refuse on a GPU): a recorded step is a
//! CUDA graph, which holds kernels only, so the ops listed in [`REFUSED_WHILE_RECORDING`] fail
//! while one is being recorded, through [`outside_recording`], the one check both devices'
//! `outside` helpers make; the step's position is one i32 in device memory
//! ([`step_position_word`]); and only the attention kernels that read that position can be
//! recorded ([`recordable_attention`]).

use super::{BackendError, Result};
use crate::footprint::attention::SPLIT_ROWS;

/// Device bytes the position of recorded steps takes (an i32).
pub const STEP_POSITION_BYTES: usize = 4;

/// What fails while a step is being recorded, by the name the devices' `outside` helpers give
/// it: each is nothing a CUDA graph holds. CUDA and the budgeted device refuse the same trait
/// ops; CUDA names two of its own steps besides (every allocation, and the copy of a neuron
/// list), which is how it refuses the ops that take them.
pub const REFUSED_WHILE_RECORDING: &[&str] = &[
    // Device memory taken or reshaped: a graph's buffers are fixed when it is recorded.
    "alloc",
    "alloc_weight",
    "alloc_bundles",
    "alloc_kv",
    "alloc_kv_table",
    "retype_weight",
    "set_workspace",
    "an allocation",
    // Copies between host and device, and their pace.
    "upload",
    "upload_bundles",
    "map_bundles",
    "upload_into",
    "upload_laid_out",
    "pace_copies",
    "write",
    "read",
    "read_queued",
    "write_kv_table",
    "read_kv",
    "read_kv_raw",
    "write_kv",
    "write_kv_raw",
    "embed",
    "ffn_bundles_up_listed",
    "ffn_bundles_down_listed",
    "ffn_bundles_listed",
    "scatter_rows",
    "a neuron list",
    // A position taken as an argument (a replay would repeat it), and the step position itself.
    "add_table_rows",
    "set_step_position",
    // Waits and the order between streams.
    "copies_done",
    "compute_done",
    "compute_waits",
    "copies_wait",
    "host_waits",
    // A recording inside a recording.
    "record",
    "replay",
];

/// Fail while a step is being recorded (`recording`): `op` is nothing a CUDA graph holds (an
/// allocation, a copy between host and device, a wait). CUDA and the budgeted device alike.
/// `op` is one of [`REFUSED_WHILE_RECORDING`].
pub(super) fn outside_recording(op: &'static str, recording: bool) -> Result<()> {
    debug_assert!(
        REFUSED_WHILE_RECORDING.contains(&op),
        "`{op}` is refused while recording but not listed in REFUSED_WHILE_RECORDING"
    );
    if recording {
        return Err(BackendError::Device(format!(
            "{op} inside a recorded step: a CUDA graph holds kernels only (no allocation, no copy \
             between host and device, no wait)"
        )));
    }
    Ok(())
}

/// A step recorded or replayed before
/// [`Backend::set_step_position`](super::Backend::set_step_position).
pub(super) fn position_unset() -> BackendError {
    BackendError::Device("a step recorded or replayed before its position was set".into())
}

pub(super) fn not_recorded(op: &'static str) -> BackendError {
    BackendError::Shape {
        op,
        msg: "this backend does not record steps".into(),
    }
}

/// The step position as the recorded kernels read it (an i32), if it is one.
pub fn step_position_word(first_pos: usize) -> Result<i32> {
    i32::try_from(first_pos).map_err(|_| BackendError::Shape {
        op: "set_step_position",
        msg: format!("position {first_pos}: a recorded step's is below 2³¹"),
    })
}

/// Whether the attention of `rows` query rows can be recorded, else why not: the split and the
/// simple kernels, which take up to [`SPLIT_ROWS`] rows, read their position from device memory;
/// the flash kernel (prompts) takes it as an argument. The budgeted device refuses what this
/// refuses.
pub fn recordable_attention(rows: usize) -> Result<()> {
    if (1..=SPLIT_ROWS).contains(&rows) {
        return Ok(());
    }
    Err(BackendError::Shape {
        op: "attention",
        msg: format!(
            "{rows} rows: CUDA's kernels for more than {SPLIT_ROWS} take their position as an \
             argument, so this step cannot be recorded"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::sim::SimBackend;
    use crate::backend::{Act, Backend, BundleShape, KvType};
    use crate::footprint::ledger::Ledger;
    use crate::store::Encoding;
    use crate::tensor::{Bytes, DType, HostTensor};

    #[test]
    fn recorded_positions_and_attention_rows_are_bounded() {
        assert_eq!(step_position_word(7).unwrap(), 7);
        assert_eq!(step_position_word(i32::MAX as usize).unwrap(), i32::MAX);
        let e = step_position_word(i32::MAX as usize + 1).unwrap_err();
        assert!(e.to_string().contains("below 2³¹"), "{e}");
        assert!(recordable_attention(1).is_ok() && recordable_attention(SPLIT_ROWS).is_ok());
        for rows in [0, SPLIT_ROWS + 1] {
            let e = recordable_attention(rows).unwrap_err().to_string();
            assert!(e.contains("cannot be recorded"), "{e}");
        }
    }

    #[test]
    fn listed_ops_fail_only_while_recording() {
        let mut seen = std::collections::HashSet::new();
        for &op in REFUSED_WHILE_RECORDING {
            assert!(seen.insert(op), "{op} listed twice");
            assert!(outside_recording(op, false).is_ok());
            let e = outside_recording(op, true).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("device error: {op} inside a recorded step")),
                "{e}"
            );
        }
    }

    /// Calls `ops` as a recorded step; what refused them.
    fn refusal(sim: &SimBackend, ops: impl FnOnce() -> Result<()>) -> String {
        sim.record(ops)
            .err()
            .map_or("not refused".into(), |e| e.to_string())
    }

    /// The neuron-list ops tried while recording (their weights and tensors made first).
    fn neuron_list_refusals(sim: &SimBackend) -> Vec<(&'static str, String)> {
        let shape = BundleShape { parts: 2, d: 32 };
        let raw = Bytes::from_slice(&[0u8; 256]);
        let host = HostTensor::from_f32("w", 2, 32, vec![0.5; 64]);
        let w = sim.upload(&host).unwrap();
        let mut slot = sim.alloc_weight("slot", DType::F32, 2, 32).unwrap();
        let b = sim.upload_bundles("b", Encoding::F32, shape, &raw).unwrap();
        let (mut x, mut h) = (sim.alloc(1, 32).unwrap(), sim.alloc(1, 2).unwrap());
        let mut y = sim.alloc(1, 32).unwrap();
        vec![
            (
                "ffn_bundles_up_listed",
                refusal(sim, || {
                    sim.ffn_bundles_up_listed(&b, shape, &x, Act::Relu, 0.0, None, &[0], &mut h)
                }),
            ),
            (
                "ffn_bundles_down_listed",
                refusal(sim, || {
                    sim.ffn_bundles_down_listed(&b, shape, &h, (&[0], &[0]), &mut x)
                }),
            ),
            (
                "ffn_bundles_listed",
                refusal(sim, || {
                    let how = (Act::Relu, 0.0);
                    let listed = (&[0u32][..], &[0u32][..]);
                    sim.ffn_bundles_listed_from(
                        (&b, None),
                        shape,
                        &x,
                        how,
                        None,
                        listed,
                        &mut h,
                        &mut y,
                    )
                }),
            ),
            (
                "scatter_rows",
                refusal(sim, || sim.scatter_rows(&w, &[1], &mut slot)),
            ),
        ]
    }

    #[test]
    fn the_budgeted_device_refuses_every_listed_op_while_recording() {
        let sim = SimBackend::new(CpuBackend::new(1).unwrap(), Ledger::new(None, None));
        let shape = BundleShape { parts: 2, d: 32 };
        let host = HostTensor::from_f32("w", 2, 32, vec![0.5; 64]);
        let raw = Bytes::from_slice(&[0u8; 256]);
        let mut w = sim.upload(&host).unwrap();
        let mut x = sim.alloc(1, 32).unwrap();
        let mut kv = sim.alloc_kv(16, 32, KvType::F32).unwrap();
        let mut table = sim.alloc_kv_table(1).unwrap();
        sim.set_workspace(1 << 20).unwrap();
        sim.set_step_position(0).unwrap();
        let (mut values, mut bytes) = (vec![0f32; 32], vec![0u8; 128]);
        let now = std::time::Instant::now();
        let mut tried: Vec<(&str, String)> = vec![
            ("alloc", refusal(&sim, || sim.alloc(1, 1).map(drop))),
            (
                "alloc_weight",
                refusal(&sim, || sim.alloc_weight("s", DType::F32, 1, 32).map(drop)),
            ),
            (
                "alloc_bundles",
                refusal(&sim, || {
                    sim.alloc_bundles("s", Encoding::F32, shape, 1).map(drop)
                }),
            ),
            (
                "alloc_kv",
                refusal(&sim, || sim.alloc_kv(16, 32, KvType::F32).map(drop)),
            ),
            (
                "alloc_kv_table",
                refusal(&sim, || sim.alloc_kv_table(1).map(drop)),
            ),
            (
                "retype_weight",
                refusal(&sim, || sim.retype_weight(&mut w, DType::F32, 2, 32)),
            ),
            ("set_workspace", refusal(&sim, || sim.set_workspace(0))),
            ("upload", refusal(&sim, || sim.upload(&host).map(drop))),
            (
                "upload_bundles",
                refusal(&sim, || {
                    sim.upload_bundles("s", Encoding::F32, shape, &raw)
                        .map(drop)
                }),
            ),
            (
                "map_bundles",
                refusal(&sim, || {
                    let page = Bytes::Aligned {
                        buf: std::sync::Arc::new(crate::tensor::AlignedBuf::zeroed(256)),
                        range: 0..256,
                    };
                    sim.map_bundles("m", Encoding::F32, shape, &page).map(drop)
                }),
            ),
            (
                "upload_into",
                refusal(&sim, || sim.upload_into(&mut w, 0, &bytes)),
            ),
            (
                "upload_laid_out",
                refusal(&sim, || sim.upload_laid_out(&mut w, &bytes)),
            ),
            ("pace_copies", refusal(&sim, || sim.pace_copies(1e9))),
            ("write", refusal(&sim, || sim.write(&mut x, &values))),
            ("read", refusal(&sim, || sim.read(&x, &mut values))),
            // SAFETY: `values` is not touched until the call has returned (it copies at once).
            (
                "read_queued",
                refusal(&sim, || {
                    unsafe { sim.read_queued(&x, &mut values) }.map(drop)
                }),
            ),
            (
                "write_kv_table",
                refusal(&sim, || sim.write_kv_table(&mut table, &[0])),
            ),
            (
                "read_kv",
                refusal(&sim, || sim.read_kv(&kv, 0, &mut values)),
            ),
            (
                "read_kv_raw",
                refusal(&sim, || sim.read_kv_raw(&kv, 0, &mut bytes)),
            ),
            (
                "write_kv",
                refusal(&sim, || sim.write_kv(&mut kv, 0, &values)),
            ),
            (
                "write_kv_raw",
                refusal(&sim, || sim.write_kv_raw(&mut kv, 0, &bytes)),
            ),
            ("embed", refusal(&sim, || sim.embed(&w, &[0], &mut x))),
            (
                "add_table_rows",
                refusal(&sim, || sim.add_table_rows(&mut x, &w, 0)),
            ),
            (
                "set_step_position",
                refusal(&sim, || sim.set_step_position(0)),
            ),
            ("copies_done", refusal(&sim, || sim.copies_done().map(drop))),
            (
                "compute_done",
                refusal(&sim, || sim.compute_done().map(drop)),
            ),
            ("compute_waits", refusal(&sim, || sim.compute_waits(&now))),
            ("copies_wait", refusal(&sim, || sim.copies_wait(&now))),
            ("host_waits", refusal(&sim, || sim.host_waits(&now))),
        ];
        tried.extend(neuron_list_refusals(&sim));
        for (op, e) in &tried {
            assert!(
                e.starts_with(&format!("device error: {op} inside a recorded step")),
                "{op}: {e}"
            );
        }
        // A recording inside one: the budgeted device has one step signed at a time.
        let nested = refusal(&sim, || sim.record(|| Ok::<(), BackendError>(())).map(drop));
        assert!(nested.contains("already being recorded"), "{nested}");
        // Every op listed is tried here, but CUDA's own steps (its allocations, its neuron
        // lists) and the recording calls.
        let mut names: Vec<&str> = tried.iter().map(|t| t.0).collect();
        names.extend(["an allocation", "a neuron list", "record", "replay"]);
        names.sort_unstable();
        let mut listed = REFUSED_WHILE_RECORDING.to_vec();
        listed.sort_unstable();
        assert_eq!(names, listed);
    }
}
