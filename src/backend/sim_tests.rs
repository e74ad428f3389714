//! Tests of the budgeted device (a child module of `sim`, kept in its own file).
use super::*;
use std::time::Duration;

#[test]
fn device_memory_is_budgeted_and_copies_counted() {
    let ledger = Ledger::new(Some(1024), None);
    let sim = SimBackend::new(CpuBackend::new(1).unwrap(), ledger.clone());
    let w = HostTensor::from_f32("w", 10, 10, vec![1.0; 100]);
    let dw = sim.upload(&w).unwrap(); // 400 bytes, 512 on the device
    let mut t = sim.alloc(2, 50).unwrap(); // 400 bytes, 512 on the device
    assert!(matches!(
        sim.alloc(1, 1),
        Err(BackendError::OutOfMemory { .. })
    ));
    sim.write(&mut t, &[0.5; 100]).unwrap();
    let mut back = vec![0f32; 100];
    sim.read(&t, &mut back).unwrap();
    let s = ledger.snapshot();
    assert_eq!((s.hbm_used, s.h2d_bytes, s.d2h_bytes), (1024, 800, 400));
    drop((dw, t));
    assert_eq!(ledger.snapshot().hbm_used, 0);
    assert_eq!(ledger.snapshot().hbm_peak, 1024);
}

#[test]
fn a_recorded_step_holds_kernels_only_and_reads_the_step_position() {
    let sim = SimBackend::new(CpuBackend::new(1).unwrap(), Ledger::new(None, None));
    let inv = sim
        .upload(&HostTensor::from_f32("inv", 1, 2, vec![1.0, 0.25]))
        .unwrap();
    let row = [1.0, 2.0, 3.0, 4.0];
    let fresh = |v: &[f32]| {
        let mut t = sim.alloc(1, 4).unwrap();
        sim.write(&mut t, v).unwrap();
        t
    };
    let read = |t: &SimTensor| {
        let mut v = vec![0f32; 4];
        sim.read(t, &mut v).unwrap();
        v
    };
    let none = || Ok::<(), BackendError>(());
    let err = sim.record(none).err().unwrap().to_string();
    assert!(err.contains("before its position was set"), "{err}");
    sim.set_step_position(7).unwrap();
    // Nothing but kernels: an allocation fails the recording, and the next one starts clean.
    let err = sim.record(|| sim.alloc(1, 1).map(|_| ())).err().unwrap();
    assert!(err.to_string().contains("inside a recorded step"), "{err}");
    // Recorded with a stale position argument, the rotation is the step position's.
    let mut want = fresh(&row);
    sim.rope(&mut want, 4, 4, RopePairs::Adjacent, &inv, 7)
        .unwrap();
    let mut x = fresh(&row);
    let rec = sim
        .record(|| sim.rope(&mut x, 4, 4, RopePairs::Adjacent, &inv, 123))
        .unwrap();
    assert_eq!(read(&x), read(&want));
    // Replayed at another position over the same buffer: that position's rotation.
    sim.write(&mut x, &row).unwrap();
    sim.rope(&mut want, 4, 4, RopePairs::Adjacent, &inv, 0)
        .unwrap();
    let mut want9 = fresh(&row);
    sim.rope(&mut want9, 4, 4, RopePairs::Adjacent, &inv, 9)
        .unwrap();
    sim.set_step_position(9).unwrap();
    sim.replay(&rec, || {
        sim.rope(&mut x, 4, 4, RopePairs::Adjacent, &inv, 7)
    })
    .unwrap();
    assert_eq!(read(&x), read(&want9));
    // Over another buffer, or with another op, a graph would have run the recording: refused.
    let mut y = fresh(&row);
    let err = sim
        .replay(&rec, || {
            sim.rope(&mut y, 4, 4, RopePairs::Adjacent, &inv, 9)
        })
        .err()
        .unwrap();
    assert!(err.to_string().contains("not its recording"), "{err}");
    let err = sim.replay(&rec, || sim.zero(&mut x)).err().unwrap();
    assert!(err.to_string().contains("not its recording"), "{err}");
}

#[test]
fn ops_fail_without_the_workspace_cuda_would_take() {
    let ledger = Ledger::new(None, None);
    let sim = SimBackend::new(CpuBackend::new(1).unwrap(), ledger.clone());
    let w = sim
        .upload(&HostTensor::from_f32("w", 4, 64, vec![0.5; 256]))
        .unwrap();
    let x = sim.alloc(16, 64).unwrap();
    let mut out = sim.alloc(16, 4).unwrap();
    // An f32 weight needs no workspace: cuBLAS reads the activations in place.
    sim.matmul_into(&w, &x, &mut out, 0).unwrap();
    let halves: Vec<u8> = (0..256)
        .flat_map(|_| half::f16::from_f32(0.5).to_le_bytes())
        .collect();
    let w16 = sim
        .upload(&HostTensor {
            name: "w16".into(),
            rows: 4,
            cols: 64,
            dtype: DType::F16,
            data: Bytes::from_slice(&halves),
        })
        .unwrap();
    let need = sim.workspace_bytes(&WorkspaceOp::Matmul {
        dtype: DType::F16,
        tokens: 16,
        rows: 4,
        cols: 64,
    });
    assert!(need > 0);
    let err = sim.matmul_into(&w16, &x, &mut out, 0).unwrap_err();
    assert!(matches!(err, BackendError::Workspace { .. }), "{err}");
    sim.set_workspace(need).unwrap();
    assert_eq!(sim.workspace_held(), need);
    let before = ledger.snapshot().hbm_used;
    sim.matmul_into(&w16, &x, &mut out, 0).unwrap();
    sim.set_workspace(0).unwrap();
    assert_eq!(ledger.snapshot().hbm_used, before - need);
}

/// The link's pacing never ends a copy early: waits of a few microseconds (spun) and longer
/// ones (slept, then spun) return at or after their end.
#[test]
fn paced_waits_end_no_earlier_than_asked() {
    for us in [0u64, 3, 25, 300, 2000] {
        let end = Instant::now() + Duration::from_micros(us);
        wait_until(end);
        assert!(Instant::now() >= end, "{us} µs");
    }
}

/// Weight copies queue on the paced link as on CUDA's copy stream: an upload returns at once
/// with its bytes in place, its event ends when they have crossed at the link's rate (behind the
/// copy queued before it), and whoever waits on the event (the compute or the host) returns no
/// earlier.
#[test]
fn weight_copies_queue_on_the_link_and_their_readers_wait() {
    let ledger = Ledger::new(None, None);
    let sim = SimBackend::new(CpuBackend::new(1).unwrap(), ledger.clone());
    // A hundred bytes a millisecond: each 8 KiB copy takes 82 ms of link.
    let rate = 1e5;
    let half = 8192;
    let crossing = Duration::from_secs_f64(half as f64 / rate);
    sim.pace_copies(rate).unwrap();
    let mut slot = sim.alloc_weight("slot", DType::F32, 4, 1024).unwrap();
    let bytes: Vec<u8> = (0..2 * half).map(|i| (i % 251) as u8).collect();
    let t0 = Instant::now();
    sim.upload_into(&mut slot, 0, &bytes[..half]).unwrap();
    let first = sim.copies_done().unwrap();
    sim.upload_into(&mut slot, 2, &bytes[half..]).unwrap();
    let second = sim.copies_done().unwrap();
    assert!(
        Instant::now() < first,
        "the uploads returned before their bytes crossed"
    );
    assert_eq!(
        slot.w.as_tensor().unwrap().data.as_slice(),
        &bytes[..],
        "the bytes are in place"
    );
    assert!(first >= t0 + crossing && second >= first + crossing);
    sim.compute_waits(&first).unwrap();
    assert!(
        Instant::now() >= first,
        "the compute waited for the first copy"
    );
    sim.host_waits(&second).unwrap();
    assert!(Instant::now() >= second, "the host waited for the second");
    assert_eq!(ledger.snapshot().h2d_bytes, 2 * half as u64);
    // Compute is done when asked: its event is no later than now.
    assert!(sim.compute_done().unwrap() <= Instant::now());
}
