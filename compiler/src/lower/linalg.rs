//! stub
use super::Registry;
pub fn register(_r: &mut Registry) {}
