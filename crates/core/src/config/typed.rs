//! The config types several crates share: the element type and device of tensors, the simulated
//! engine's length distribution (core's seeded generator draws from it) and secrets that never
//! print. Each section's own types live with the crate that owns the section.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize, Serializer};

crate::impl_choice!(DType);

/// Element type of model weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

/// Where tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host CPU.
    Cpu,
    /// CUDA device by ordinal.
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or(()),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A completion-length distribution of the simulated engine (`[engine.simulated.lengths.*]`);
/// here because core's [`rng`](crate::rng) draws lengths from it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "distribution", rename_all = "snake_case")]
pub enum LengthDistribution {
    /// Always `tokens`.
    Fixed {
        /// The length.
        tokens: u32,
    },
    /// Uniform in `[min, max]`.
    Uniform {
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
    /// Log-normal with the given median and σ (a long tail).
    Lognormal {
        /// Median length.
        median: f64,
        /// σ of the underlying normal.
        sigma: f64,
    },
}

/// What a [`Secret`] prints as; refused as a token value, so a printed config cannot run with it.
pub const REDACTED: &str = "<redacted>";

/// A secret that never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The secret itself; call only where it is compared or sent.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}
