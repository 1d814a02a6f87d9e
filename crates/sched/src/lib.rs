//! deltaserve-sched: pure bookkeeping of what runs in each engine step: the waiting queue, continuous
//! batching within a token budget, KV page and DeltaNet slot pools, admission and preemption.
//! No GPU, no async, no clock: every decision is a function of the calls made, so tests replay
//! workloads as deterministic simulations and check the pools' invariants after every step.

pub mod pools;
pub mod prefix;
pub mod scheduler;

pub use pools::{PagePool, SlotPool};
pub use prefix::{Hit, MediaSpan, PrefixCache, PrefixCacheConfig, PrefixStats, cache_key};
pub use scheduler::{AdmitError, SchedConfig, SchedStats, Scheduler, SeqId, SeqOptions, StepPlan, check_request};
