//! Owned `PJRT_Event`s: awaiting one surfaces the asynchronous work's error, and dropping one
//! destroys it whether or not it was awaited.

use crate::error::Result;
use crate::plugin::{call, Plugin};
use pjrt_sys::{PJRT_Event, PJRT_Event_Await_Args, PJRT_Event_Destroy_Args, PJRT_Event_IsReady_Args};

pub(crate) struct Event<'p> {
    plugin: &'p Plugin,
    raw: *mut PJRT_Event,
}

impl<'p> Event<'p> {
    /// Takes ownership of `raw`; `None` when the plugin returned no event.
    pub(crate) fn adopt(plugin: &'p Plugin, raw: *mut PJRT_Event) -> Option<Self> {
        (!raw.is_null()).then_some(Event { plugin, raw })
    }

    /// Blocks until the event is ready and returns its error, if any.
    pub(crate) fn wait(self) -> Result<()> {
        let mut args = PJRT_Event_Await_Args::new();
        args.event = self.raw;
        call!(self.plugin, PJRT_Event_Await, &mut args)
    }

    /// Whether the event is ready, without blocking; `false` if the plugin cannot say.
    pub(crate) fn is_ready(&self) -> bool {
        let mut args = PJRT_Event_IsReady_Args::new();
        args.event = self.raw;
        call!(self.plugin, PJRT_Event_IsReady, &mut args).is_ok() && args.is_ready
    }
}

/// Awaits an optional event (absent means already done).
pub(crate) fn wait(plugin: &Plugin, raw: *mut PJRT_Event) -> Result<()> {
    Event::adopt(plugin, raw).map_or(Ok(()), Event::wait)
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        let mut args = PJRT_Event_Destroy_Args::new();
        args.event = self.raw;
        // Nothing useful can be done with a failure to destroy.
        let _ = call!(self.plugin, PJRT_Event_Destroy, &mut args);
    }
}
