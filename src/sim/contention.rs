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

/// One measured co-run: a lane of kind `me` beside one busy lane of kind
/// `other`, its iteration time alone and beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CoRun {
    /// The lane measured.
    pub me: JobKind,
    /// The other busy lane.
    pub other: JobKind,
    /// Under the priority policy (its inference streams outrank training).
    pub priority: bool,
    /// Mean iteration time alone (any unit, the same as `beside`).
    pub alone: f64,
    /// Mean iteration time beside the other lane.
    pub beside: f64,
}

/// Why co-runs could not be fitted into a table.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// A line of the co-run table is not `me,other,alone,beside[,priority]`.
    #[error("co-run line {line}: {reason}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A pair of kinds has no co-run.
    #[error("no co-run of {me} beside {other}: every pair of kinds needs one")]
    Missing {
        /// The lane's kind.
        me: &'static str,
        /// The other's.
        other: &'static str,
    },
    /// The fitted speeds do not make a table.
    #[error(transparent)]
    Table(#[from] ContentionError),
}

impl Contention {
    /// Fit a table to measured co-runs: each pair's speed is the mean over
    /// its co-runs of `alone / beside`, capped at 1 (a lane is never
    /// faster beside another). The priority key takes the co-runs under
    /// the priority policy, or the plain training-beside-inference speed
    /// when there are none. Every other pair needs at least one co-run.
    pub fn fit(runs: &[CoRun]) -> Result<Contention, FitError> {
        use JobKind::{Inference, Training};
        let mean = |me: JobKind, other: JobKind, priority: bool| -> Option<f64> {
            let v: Vec<f64> = runs
                .iter()
                .filter(|r| r.me == me && r.other == other && r.priority == priority)
                .map(|r| (r.alone / r.beside).min(1.0))
                .collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
        };
        let need = |me: JobKind, other: JobKind| {
            mean(me, other, false).ok_or(FitError::Missing {
                me: me.as_str(),
                other: other.as_str(),
            })
        };
        let training_beside_inference = need(Training, Inference)?;
        let c = Contention {
            training_beside_inference,
            priority_training_beside_inference: mean(Training, Inference, true)
                .unwrap_or(training_beside_inference),
            inference_beside_training: need(Inference, Training)?,
            training_beside_training: need(Training, Training)?,
            inference_beside_inference: need(Inference, Inference)?,
        };
        // Checked as a file would be (speeds in (0, 1]).
        Ok(Contention::from_toml(&c.to_toml())?)
    }

    /// Read co-runs from CSV lines `me,other,alone,beside[,priority]`
    /// (kinds `training`/`inference`, times in one unit, `priority` 1 or
    /// true for runs under the priority policy); a header line starting
    /// with `me` and `#` comments are skipped.
    pub fn read_coruns(text: &str) -> Result<Vec<CoRun>, FitError> {
        let mut out = Vec::new();
        for (n, raw) in text.lines().enumerate() {
            let line = n + 1;
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') || (n == 0 && l.starts_with("me")) {
                continue;
            }
            let bad = |reason: String| FitError::Line { line, reason };
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            if !(4..=5).contains(&f.len()) {
                return Err(bad(format!(
                    "{} fields, expected me,other,alone,beside[,priority]",
                    f.len()
                )));
            }
            let kind = |s: &str| match s {
                "training" => Ok(JobKind::Training),
                "inference" => Ok(JobKind::Inference),
                other => Err(bad(format!("kind {other:?} is not training or inference"))),
            };
            let time = |s: &str| -> Result<f64, FitError> {
                match s.parse::<f64>() {
                    Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
                    _ => Err(bad(format!("{s:?} is not a positive time"))),
                }
            };
            let priority = match f.get(4).copied() {
                None | Some("") | Some("0") | Some("false") => false,
                Some("1") | Some("true") => true,
                Some(other) => return Err(bad(format!("priority {other:?} is not 0/1"))),
            };
            out.push(CoRun {
                me: kind(f[0])?,
                other: kind(f[1])?,
                priority,
                alone: time(f[2])?,
                beside: time(f[3])?,
            });
        }
        Ok(out)
    }

    /// The table as TOML, in the layout [`Contention::from_toml`] reads.
    pub fn to_toml(&self) -> String {
        format!(
            "training_beside_inference = {}\n\
             priority_training_beside_inference = {}\n\
             inference_beside_training = {}\n\
             training_beside_training = {}\n\
             inference_beside_inference = {}\n",
            self.training_beside_inference,
            self.priority_training_beside_inference,
            self.inference_beside_training,
            self.training_beside_training,
            self.inference_beside_inference,
        )
    }

    /// The table fitted to `lanes replay` pair runs of resnet18_cifar on an
    /// H100 (`src/sim/contention/h100-resnet18-cifar.toml`).
    pub fn h100_resnet18_cifar() -> Result<Contention, ContentionError> {
        Contention::from_toml(include_str!("contention/h100-resnet18-cifar.toml"))
    }

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
    fn the_fitted_resnet18_table_parses() {
        let c = Contention::h100_resnet18_cifar().unwrap();
        assert_eq!(c.training_beside_training, 0.6765);
        assert_eq!(c.training_beside_inference, 0.734);
        assert_eq!(c.inference_beside_training, 0.677);
    }

    #[test]
    fn co_runs_fit_into_a_table_that_round_trips() {
        let text = "me,other,alone,beside,priority\n\
                    # a comment\n\
                    training,training,10,20\n\
                    training,training,10,10\n\
                    training,inference,8,10\n\
                    inference,training,3,4\n\
                    inference,inference,5,4\n";
        let runs = Contention::read_coruns(text).unwrap();
        assert_eq!(runs.len(), 5);
        let c = Contention::fit(&runs).unwrap();
        // Mean of 0.5 and 1.0.
        assert!((c.training_beside_training - 0.75).abs() < 1e-12);
        assert!((c.training_beside_inference - 0.8).abs() < 1e-12);
        // No priority run: the plain speed.
        assert_eq!(c.priority_training_beside_inference, 0.8);
        assert!((c.inference_beside_training - 0.75).abs() < 1e-12);
        // Faster beside another is capped at 1.
        assert_eq!(c.inference_beside_inference, 1.0);
        assert_eq!(Contention::from_toml(&c.to_toml()).unwrap(), c);
        let with_priority = format!("{text}training,inference,8,16,1\n");
        let p = Contention::fit(&Contention::read_coruns(&with_priority).unwrap()).unwrap();
        assert!((p.priority_training_beside_inference - 0.5).abs() < 1e-12);
        assert!((p.training_beside_inference - 0.8).abs() < 1e-12);
    }

    #[test]
    fn bad_co_runs_say_which_line() {
        for (text, line) in [
            ("training,training,1\n", 1),
            ("training,training,1,2\ngpu,training,1,2\n", 2),
            ("training,training,1,-2\n", 1),
            ("training,training,1,nan\n", 1),
            ("me,other\ntraining,training,1,2,maybe\n", 2),
        ] {
            match Contention::read_coruns(text) {
                Err(FitError::Line { line: l, .. }) => assert_eq!(l, line, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        let partial = Contention::read_coruns("training,training,1,2\n").unwrap();
        assert!(matches!(
            Contention::fit(&partial),
            Err(FitError::Missing { .. })
        ));
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
