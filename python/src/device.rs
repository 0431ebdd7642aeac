//! The process-wide PJRT client: one per process, created on first use. A failed discovery is
//! not remembered, so installing a plugin and retrying works without a restart.
use std::sync::{Arc, Mutex};

use tpu_dynamo_runtime::{Client, ClientOptions, Device, Error, Plugin};

pub struct Target {
    pub client: Client,
    pub device: Device,
}

static TARGET: Mutex<Option<Arc<Target>>> = Mutex::new(None);

pub fn target() -> Result<Arc<Target>, Error> {
    let mut slot = TARGET.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(t) = slot.as_ref() {
        return Ok(t.clone());
    }
    let client = Client::new(Plugin::discover(None)?, &ClientOptions::default())?;
    let device = client
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidArgument("the PJRT plugin reports no devices".into()))?;
    let t = Arc::new(Target { client, device });
    *slot = Some(t.clone());
    Ok(t)
}
