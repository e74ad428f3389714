//! Host memory on the way to and from a device: the stage a device→host copy lands in (or a
//! host→device copy leaves from), page-locked where the backend pins, and the landing that
//! waits for a queued copy before its values are read; and the pace host→device copies may be
//! held to (`--emulate`), checked alike by every device that paces.

use super::{Backend, BackendError, Result};

/// Keeps a host range page-locked while alive.
pub type HostPin = Box<dyn std::any::Any + Send + Sync>;

/// Host memory a device→host copy lands in while the host goes on with other work, or a
/// host→device copy is sent from: page-locked where the backend pins (a copy into pageable
/// memory returns only once it has landed, so nothing would overlap it; one from it is staged
/// by the driver first, at a fraction of the rate).
pub struct HostStage {
    // Declared first: dropped (unpinned) before the buffer is freed.
    _pin: Option<HostPin>,
    // Whole pages, so pinning it never touches a page another allocation shares.
    buf: crate::tensor::AlignedBuf,
    len: usize,
}

impl HostStage {
    /// Room for `values` f32s, pinned by `b` where it pins.
    pub fn new<B: Backend>(b: &B, values: usize) -> Result<Self> {
        let mut buf = crate::tensor::AlignedBuf::zeroed(values * 4);
        let pin = b.pin_host(buf.padded_mut())?;
        Ok(HostStage {
            _pin: pin,
            buf,
            len: values,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn values(&self) -> &[f32] {
        bytemuck::cast_slice(self.buf.as_slice())
    }

    pub(crate) fn values_mut(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(self.buf.as_mut_slice())
    }

    /// The stage as bytes (a host→device source: gathered into, then copied from).
    pub(crate) fn bytes(&self) -> &[u8] {
        self.buf.as_slice()
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }
}

/// A device→host copy in flight into a [`HostStage`]. [`Landing::wait`] blocks (the event
/// waits, it does not spin) until the values have landed and hands them out; dropping it
/// unwaited waits too, so the stage is never read, reused or freed under the copy.
pub struct Landing<'a, B: Backend> {
    backend: &'a B,
    event: Option<B::Event>,
    stage: Option<&'a mut HostStage>,
    len: usize,
}

impl<'a, B: Backend> Landing<'a, B> {
    /// Queue the copy of all of `src` into `stage`, behind the compute queued so far.
    pub fn start(backend: &'a B, src: &B::Tensor, stage: &'a mut HostStage) -> Result<Self> {
        let (rows, cols) = backend.shape(src);
        let len = rows * cols;
        if len > stage.len() {
            return Err(BackendError::Shape {
                op: "read_queued",
                msg: format!("{rows}x{cols} values into a stage of {}", stage.len()),
            });
        }
        // SAFETY: the stage stays mutably borrowed by the landing until the event has been
        // waited on (in `wait` or on drop).
        let event = unsafe { backend.read_queued(src, &mut stage.values_mut()[..len]) }?;
        Ok(Landing {
            backend,
            event: Some(event),
            stage: Some(stage),
            len,
        })
    }

    /// Block until the copy has landed; the values.
    pub fn wait(mut self) -> Result<&'a [f32]> {
        if let Some(ev) = self.event.take() {
            self.backend.host_waits(&ev)?;
        }
        let stage = self
            .stage
            .take()
            .ok_or_else(|| BackendError::Device("a landing waited on twice".into()))?;
        Ok(&stage.values()[..self.len])
    }
}

impl<B: Backend> Drop for Landing<'_, B> {
    fn drop(&mut self) {
        if let Some(ev) = self.event.take() {
            // An error here leaves nothing better to do than not to touch the stage, which
            // the borrow already ensures until now.
            if let Err(e) = self.backend.host_waits(&ev) {
                tracing::error!("waiting for a device→host copy: {e}");
            }
        }
    }
}

/// The rate [`Backend::pace_copies`] holds host→device copies to, checked as every device that
/// paces checks it (CUDA and the budgeted device): finite and positive.
pub fn check_pace_rate(bytes_per_s: f64) -> Result<()> {
    if !(bytes_per_s.is_finite() && bytes_per_s > 0.0) {
        return Err(BackendError::Device(format!(
            "copy pacing needs a positive rate, not {bytes_per_s}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_pace_rate;

    #[test]
    fn copies_are_paced_at_finite_positive_rates_only() {
        assert!(check_pace_rate(1.0).is_ok() && check_pace_rate(25e9).is_ok());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = check_pace_rate(bad).unwrap_err().to_string();
            assert!(e.contains("needs a positive rate"), "{e}");
        }
    }
}
