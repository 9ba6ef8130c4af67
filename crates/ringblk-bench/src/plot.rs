//! The comparison as an SVG: for each (workload, queues, O_DIRECT) a row of
//! two charts, IOPS and p99 latency against iodepth, one line per backend.
//! The iodepth axis is log2, so 1, 16 and 64 are not squeezed together.

use std::path::Path;

use plotters::prelude::*;

use super::BenchError;
use super::backends::Config;
use super::compare::CompareDoc;
use super::images::Image;
use super::tables::by_config;

/// Backend colours, see [`colour`].
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// The same colour for the same backend in every chart and every run:
/// ringblk blue, qsd red, host green, variants the rest by position.
fn colour(name: &str, index: usize) -> RGBColor {
    let i = match name {
        "ringblk" => 0,
        "qsd" => 1,
        "host" => 2,
        _ => 3 + index,
    };
    PALETTE[i % PALETTE.len()]
}

/// How a chart's y values are scaled (values are already transformed).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Axis {
    Linear,
    /// Values are log10 of the quantity; labels show whole decades.
    Log10,
}

/// A group of configurations that differ only in iodepth.
#[derive(PartialEq)]
struct Group {
    rw: super::RwMode,
    queues: u16,
    direct: bool,
    image: Image,
}

impl Group {
    fn of(c: &Config) -> Group {
        Group {
            rw: c.rw,
            queues: c.queues,
            direct: c.direct,
            image: c.image,
        }
    }

    fn title(&self) -> String {
        format!(
            "{}, {} queue{}, O_DIRECT {}{}",
            self.rw.name(),
            self.queues,
            if self.queues == 1 { "" } else { "s" },
            if self.direct { "on" } else { "off" },
            if self.image.is_raw() {
                String::new()
            } else {
                format!(", {}", self.image.label())
            }
        )
    }
}

/// One line: (log2 iodepth, value) points of one backend in one group.
type Line = (String, Vec<(f64, f64)>);

/// Draws `doc` into an SVG file at `path`.
pub fn draw(doc: &CompareDoc, path: &Path) -> Result<(), BenchError> {
    let backends: Vec<&str> = doc.meta.backends.iter().map(|(n, _)| n.as_str()).collect();
    let picks = by_config(doc);
    let mut groups: Vec<Group> = Vec::new();
    for (cfg, _) in &picks {
        let g = Group::of(cfg);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    if groups.is_empty() {
        return Err(BenchError::Plot {
            path: path.to_path_buf(),
            msg: "nothing to plot".into(),
        });
    }
    let depths: Vec<f64> = doc
        .records
        .iter()
        .map(|r| f64::from(r.config.iodepth.max(1)).log2())
        .collect();
    let (lo, hi) = depths
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &d| (a.min(d), b.max(d)));
    let x_range = (lo - 0.3)..(hi.max(lo + 1.0) + 0.3);

    let root = SVGBackend::new(path, (1100, 300 * groups.len() as u32)).into_drawing_area();
    let e = |e: DrawingAreaErrorKind<_>| BenchError::Plot {
        path: path.to_path_buf(),
        msg: format!("{e:?}"),
    };
    root.fill(&WHITE).map_err(e)?;
    let cells = root.split_evenly((groups.len(), 2));
    for (gi, g) in groups.iter().enumerate() {
        let lines = |metric: fn(&super::RunResult) -> f64| -> Vec<Line> {
            backends
                .iter()
                .map(|&b| {
                    let mut pts: Vec<(f64, f64)> = picks
                        .iter()
                        .flat_map(|(_, p)| p)
                        .map(|p| p.rec)
                        .filter(|r| r.backend == b && Group::of(&r.config) == *g)
                        .filter_map(|r| {
                            r.result
                                .as_ref()
                                .map(|x| (f64::from(r.config.iodepth.max(1)).log2(), metric(x)))
                        })
                        .collect();
                    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                    (b.to_string(), pts)
                })
                .collect()
        };
        let iops = lines(|x| x.iops / 1000.0);
        // Latencies span µs (host, cached) to ms (a slow backend): log10.
        let p99 = lines(|x| x.lat_us.p99.max(0.1).log10());
        chart(
            &cells[gi * 2],
            &format!("{} - kIOPS", g.title()),
            "kIOPS",
            &x_range,
            &iops,
            Axis::Linear,
        )
        .map_err(e)?;
        let caption = format!("{} - p99 latency", g.title());
        chart(
            &cells[gi * 2 + 1],
            &caption,
            "p99 us (log)",
            &x_range,
            &p99,
            Axis::Log10,
        )
        .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

fn chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    y_desc: &str,
    x_range: &std::ops::Range<f64>,
    lines: &[Line],
    axis: Axis,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let legend = axis == Axis::Linear;
    let values = || lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.1));
    let y_range = match axis {
        Axis::Linear => 0.0..values().fold(0.0, f64::max).max(1e-9) * 1.15,
        Axis::Log10 => {
            let (lo, hi) = values().fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
            if lo > hi {
                0.0..1.0
            } else {
                lo.floor()..hi.ceil().max(lo.floor() + 1.0)
            }
        }
    };
    let y_max = y_range.end;
    let y_labels = match axis {
        Axis::Linear => 10,
        Axis::Log10 => (y_range.end - y_range.start) as usize + 1,
    };
    let mut c = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(56)
        .build_cartesian_2d(x_range.clone(), y_range)?;
    c.configure_mesh()
        .max_light_lines(0)
        .x_desc("iodepth")
        .y_desc(y_desc)
        .x_labels(((x_range.end - x_range.start).ceil() as usize).max(2))
        .x_label_formatter(&|x| {
            // Only whole powers of two are real iodepths.
            if (x - x.round()).abs() < 1e-6 && *x >= 0.0 {
                format!("{}", 2f64.powf(x.round()) as u64)
            } else {
                String::new()
            }
        })
        .y_labels(y_labels)
        .y_label_formatter(&|y| match axis {
            Axis::Linear if y_max < 10.0 => format!("{y:.1}"),
            Axis::Linear => format!("{y:.0}"),
            // Whole decades only: 0.1, 1, 10, 100 ...
            Axis::Log10 if (y - y.round()).abs() < 1e-6 => format!("{}", 10f64.powf(y.round())),
            Axis::Log10 => String::new(),
        })
        .draw()?;
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = colour(name, i);
        let s = c.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?;
        if legend {
            s.label(name.as_str()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        }
        c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    if legend {
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_an_svg_with_every_backend() {
        let d = crate::tables::tests::doc(
            1,
            &[
                ("ringblk", Some(200.0)),
                ("qsd", None),
                ("host", Some(400.0)),
            ],
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("plot.svg");
        draw(&d, &path).expect("draws");
        let svg = std::fs::read_to_string(&path).expect("written");
        assert!(svg.starts_with("<svg"));
        for needle in ["ringblk", "qsd", "host", "kIOPS", "p99 latency"] {
            assert!(svg.contains(needle), "no {needle} in the SVG");
        }
    }
}
