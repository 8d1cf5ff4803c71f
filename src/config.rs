//! (being written by the config work: one registry of GSC_* knobs)
#[derive(Clone, Debug, Default)]
pub struct Config {}
