//! Summaries of simulation runs: a table for people, JSON for tools, and an
//! SVG of the JCT distribution per policy.

use std::path::Path;
use std::time::Duration;

use super::engine::SimRun;

/// The numbers `lanes simulate` reports for one policy (seconds).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Policy name.
    pub policy: String,
    /// Number of jobs.
    pub jobs: usize,
    /// Average job completion time.
    pub avg_jct_s: f64,
    /// 99th percentile JCT (nearest rank).
    pub p99_jct_s: f64,
    /// Average JCT of inference jobs (0 when there are none).
    pub avg_inference_jct_s: f64,
    /// First submission to last completion.
    pub makespan_s: f64,
    /// Average time a job waited (for admission or for its lane).
    pub avg_queueing_s: f64,
    /// 99th percentile queueing delay.
    pub p99_queueing_s: f64,
    /// Busy lane-time / (lanes × makespan).
    pub utilisation: f64,
}

/// Nearest-rank percentile of unsorted values (`p` in 0..=100).
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

impl Summary {
    /// Summarise one run.
    pub fn of(run: &SimRun) -> Summary {
        let jct: Vec<f64> = run.outcomes.iter().map(|o| o.jct().as_secs_f64()).collect();
        let inf: Vec<f64> = run
            .outcomes
            .iter()
            .filter(|o| o.kind == lanes_policies::JobKind::Inference)
            .map(|o| o.jct().as_secs_f64())
            .collect();
        let q: Vec<f64> = run
            .outcomes
            .iter()
            .map(|o| o.queueing().as_secs_f64())
            .collect();
        let first = run
            .outcomes
            .iter()
            .map(|o| o.submit)
            .min()
            .unwrap_or_default();
        let last = run
            .outcomes
            .iter()
            .map(|o| o.finish)
            .max()
            .unwrap_or_default();
        let makespan = last.saturating_sub(first);
        let capacity = makespan.as_secs_f64() * run.lanes as f64;
        Summary {
            policy: run.policy.to_string(),
            jobs: run.outcomes.len(),
            avg_jct_s: mean(&jct),
            p99_jct_s: percentile(&jct, 99.0),
            avg_inference_jct_s: mean(&inf),
            makespan_s: makespan.as_secs_f64(),
            avg_queueing_s: mean(&q),
            p99_queueing_s: percentile(&q, 99.0),
            utilisation: if capacity > 0.0 {
                run.busy.as_secs_f64() / capacity
            } else {
                0.0
            },
        }
    }
}

/// A plain-text table, one row per policy, plus each policy's average JCT
/// relative to the first row.
pub fn table(rows: &[Summary]) -> String {
    let base = rows.first().map_or(0.0, |r| r.avg_jct_s);
    // The policy column as wide as its longest name (`fifo sim as-run`).
    let w = rows
        .iter()
        .map(|r| r.policy.chars().count())
        .max()
        .unwrap_or(0)
        .max(14);
    let mut s = format!(
        "{:<w$} {:>5} {:>11} {:>11} {:>13} {:>12} {:>13} {:>7} {:>8}\n",
        "policy",
        "jobs",
        "avg JCT s",
        "p99 JCT s",
        "avg inf JCT s",
        "makespan s",
        "avg queue s",
        "util",
        "vs first"
    );
    for r in rows {
        let rel = if r.avg_jct_s > 0.0 {
            base / r.avg_jct_s
        } else {
            0.0
        };
        s.push_str(&format!(
            "{:<w$} {:>5} {:>11.2} {:>11.2} {:>13.2} {:>12.2} {:>13.2} {:>6.1}% {:>7.2}x\n",
            r.policy,
            r.jobs,
            r.avg_jct_s,
            r.p99_jct_s,
            r.avg_inference_jct_s,
            r.makespan_s,
            r.avg_queueing_s,
            r.utilisation * 100.0,
            rel
        ));
    }
    if rows.len() > 1 {
        s.push_str(&format!(
            "vs first: {}'s average JCT / the row's (above 1.00x: the row's jobs finish sooner)\n",
            rows[0].policy
        ));
    }
    s
}

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("plot {path}: {reason}")]
pub struct PlotError {
    /// The file.
    pub path: String,
    /// What failed.
    pub reason: String,
}

/// Draw the JCT distribution (empirical CDF, log-scaled seconds) of each run
/// into an SVG file.
pub fn plot_jct_cdf(runs: &[SimRun], path: &Path) -> Result<(), PlotError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| PlotError {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let series: Vec<(&str, Vec<f64>)> = runs
        .iter()
        .map(|r| {
            let mut v: Vec<f64> = r
                .outcomes
                .iter()
                .map(|o| o.jct().max(Duration::from_millis(1)).as_secs_f64())
                .collect();
            v.sort_by(f64::total_cmp);
            (r.policy, v)
        })
        .collect();
    let lo = series
        .iter()
        .filter_map(|(_, v)| v.first())
        .copied()
        .fold(f64::INFINITY, f64::min);
    let hi = series
        .iter()
        .filter_map(|(_, v)| v.last())
        .copied()
        .fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (0.001, 1.0)
    };

    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Job completion time, CDF per policy", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("JCT (s, log scale)")
        .y_desc("fraction of jobs")
        .draw()
        .map_err(|e| err(&e))?;
    // Okabe–Ito colours (readable on white and for colour-blind readers),
    // and earlier lines wider, so a line drawn over an identical one
    // leaves it visible as a border.
    const COLOURS: [RGBColor; 7] = [
        RGBColor(0, 114, 178),
        RGBColor(213, 94, 0),
        RGBColor(0, 158, 115),
        RGBColor(204, 121, 167),
        RGBColor(0, 0, 0),
        RGBColor(230, 159, 0),
        RGBColor(86, 180, 233),
    ];
    let count = series.len() as u32;
    for (k, (name, v)) in series.iter().enumerate() {
        let color = COLOURS[k % COLOURS.len()].to_rgba();
        let width = 2 + 2 * (count.saturating_sub(1 + k as u32));
        let n = v.len() as f64;
        let points: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .flat_map(|(i, &x)| [(x, i as f64 / n), (x, (i + 1) as f64 / n)])
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(width)))
            .map_err(|e| err(&e))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentile() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), 2.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
    }
}
