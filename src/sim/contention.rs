//! The GPU contention model: lanes that run at once share the GPU's
//! compute, so each runs slower than alone.
//!
//! A [`Contention`] table gives a lane's speed beside one other busy lane
//! per pair of kinds (training / inference), as a fraction of its speed
//! alone. Beside several busy lanes the slowdowns add up: a lane of kind
//! `k` beside busy lanes of kinds `k1, k2, …` runs at
//! `1 / (1 + Σ (1 / speed(k beside ki) − 1))` of its solo speed (two
//! training lanes at 0.5 each: each at half speed; three: a third). An
//! iteration's speed is fixed when it starts, from the lanes busy at that
//! instant. [`Contention::h100`]'s figures were measured with
//! `lanes bench colocate` (`contention/h100.toml`, documented in
//! `docs/scheduling.md`).

use lanes_policies::JobKind;
use serde::Deserialize;

/// Co-run speeds per pair of kinds (fractions of the solo speed, in
/// `(0, 1]`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Contention {
    /// A training lane beside an inference lane.
    pub training_beside_inference: f64,
    /// The same under the priority policy, whose inference streams outrank
    /// training on the GPU.
    pub priority_training_beside_inference: f64,
    /// An inference lane beside a training lane.
    pub inference_beside_training: f64,
    /// A training lane beside another training lane.
    pub training_beside_training: f64,
    /// An inference lane beside another inference lane.
    pub inference_beside_inference: f64,
}

/// Why a contention table was refused.
#[derive(Debug, thiserror::Error)]
pub enum ContentionError {
    /// Not valid TOML or not the expected keys.
    #[error("contention table: {0}")]
    Parse(String),
    /// A speed outside `(0, 1]`.
    #[error("contention table: {key} = {value} is not a speed in (0, 1]")]
    Speed {
        /// The key.
        key: &'static str,
        /// Its value.
        value: f64,
    },
}

impl Contention {
    /// The table measured on an H100 (`src/sim/contention/h100.toml`).
    pub fn h100() -> Contention {
        // The embedded file is checked by a test; a parse failure cannot
        // happen at run time, but stays an error rather than a panic.
        Contention::from_toml(include_str!("contention/h100.toml")).unwrap_or(Contention {
            training_beside_inference: 0.84,
            priority_training_beside_inference: 0.68,
            inference_beside_training: 0.75,
            training_beside_training: 0.5,
            inference_beside_inference: 0.5,
        })
    }

    /// Parse and check a table.
    pub fn from_toml(text: &str) -> Result<Contention, ContentionError> {
        let c: Contention =
            toml::from_str(text).map_err(|e| ContentionError::Parse(e.to_string()))?;
        for (key, value) in [
            ("training_beside_inference", c.training_beside_inference),
            (
                "priority_training_beside_inference",
                c.priority_training_beside_inference,
            ),
            ("inference_beside_training", c.inference_beside_training),
            ("training_beside_training", c.training_beside_training),
            ("inference_beside_inference", c.inference_beside_inference),
        ] {
            if !(value.is_finite() && value > 0.0 && value <= 1.0) {
                return Err(ContentionError::Speed { key, value });
            }
        }
        Ok(c)
    }

    /// Speed of a lane of kind `me` beside one busy lane of kind `other`
    /// (`priority`: the priority policy runs).
    pub fn pair(&self, me: JobKind, other: JobKind, priority: bool) -> f64 {
        match (me, other) {
            (JobKind::Training, JobKind::Inference) if priority => {
                self.priority_training_beside_inference
            }
            (JobKind::Training, JobKind::Inference) => self.training_beside_inference,
            (JobKind::Inference, JobKind::Training) => self.inference_beside_training,
            (JobKind::Training, JobKind::Training) => self.training_beside_training,
            (JobKind::Inference, JobKind::Inference) => self.inference_beside_inference,
        }
    }

    /// Speed of a lane of kind `me` beside busy lanes of kinds `others`.
    pub fn speed(&self, me: JobKind, others: impl Iterator<Item = JobKind>, priority: bool) -> f64 {
        let slowdown: f64 = others.map(|o| 1.0 / self.pair(me, o, priority) - 1.0).sum();
        1.0 / (1.0 + slowdown)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use JobKind::{Inference, Training};

    #[test]
    fn the_h100_table_parses_and_slowdowns_add_up() {
        let c = Contention::from_toml(include_str!("contention/h100.toml")).unwrap();
        assert_eq!(c, Contention::h100());
        assert_eq!(c.speed(Training, std::iter::empty(), false), 1.0);
        assert_eq!(c.speed(Training, [Inference].into_iter(), false), 0.84);
        assert_eq!(c.speed(Training, [Inference].into_iter(), true), 0.68);
        assert!(
            (c.speed(Training, [Training, Training].into_iter(), false) - 1.0 / 3.0).abs() < 1e-12
        );
        assert!((c.speed(Inference, [Training].into_iter(), false) - 0.75).abs() < 1e-12);
    }

    #[test]
    fn bad_tables_are_refused() {
        let good = include_str!("contention/h100.toml");
        assert!(Contention::from_toml(&good.replace("= 0.84", "= 1.5")).is_err());
        assert!(Contention::from_toml(&good.replace("= 0.84", "= 0")).is_err());
        assert!(Contention::from_toml(&good.replace("= 0.84", "= nan")).is_err());
        assert!(Contention::from_toml("training_beside_inference = 0.8\n").is_err());
        assert!(Contention::from_toml(&format!("{good}\ngpu = 1\n")).is_err());
    }
}
