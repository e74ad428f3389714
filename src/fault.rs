//! Fault injection for tests: a pause an environment variable asks for (`GPU_OFFLOAD_TEST_…_MS`),
//! so a test can kill a process, or a store, while a step is surely under way. Read once; absent
//! (as in every real run) it costs one load.

use std::sync::OnceLock;
use std::time::Duration;

/// A pause of the milliseconds environment variable `var` names, if it is set.
pub struct TestDelay {
    var: &'static str,
    millis: OnceLock<Option<Duration>>,
}

impl TestDelay {
    pub const fn new(var: &'static str) -> Self {
        TestDelay {
            var,
            millis: OnceLock::new(),
        }
    }

    /// Sleep for the delay, where the variable asks for one.
    pub fn pause(&self) {
        let d = self.millis.get_or_init(|| {
            std::env::var(self.var)
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis)
        });
        if let Some(d) = d {
            std::thread::sleep(*d);
        }
    }
}
