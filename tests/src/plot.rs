//! The dataplane benchmark's plot: connections per second and p99 first-reply latency against
//! the number of Services, one line per mode, as a PNG (plotters into an RGB buffer, encoded
//! with `png`). Text needs a TrueType font: DejaVu Sans (Debian's fonts-dejavu-core).
use std::path::Path;

use anyhow::{bail, Context, Result};
use plotters::prelude::*;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// One mode's points: (services, conn/s, p99 µs).
pub struct Series {
    pub label: String,
    pub points: Vec<(usize, f64, Option<f64>)>,
}

/// Reads the bench's JSON (`{"modes": {label: [{"services", "conn_per_s", "p99_us"}]}}`).
pub fn series_from_json(v: &serde_json::Value) -> Result<Vec<Series>> {
    let modes = v["modes"].as_object().context("no \"modes\" in the results")?;
    Ok(modes
        .iter()
        .map(|(label, pts)| Series {
            label: label.clone(),
            points: pts
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| Some((p["services"].as_u64()? as usize, p["conn_per_s"].as_f64()?, p["p99_us"].as_f64())))
                .collect(),
        })
        .collect())
}

pub fn render(series: &[Series], title: &str, out: &Path) -> Result<()> {
    let font = std::fs::read(FONT).with_context(|| format!("reading {FONT} (Debian package fonts-dejavu-core)"))?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(font.into_boxed_slice()))
        .map_err(|_| anyhow::anyhow!("{FONT} is not a usable font"))?;
    let (w, h) = (1400u32, 560u32);
    let mut buf = vec![0u8; (w * h * 3) as usize];
    let max_n = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).max().unwrap_or(1).max(2) as f64;
    let max_cps = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(1.0, f64::max) * 1.1;
    let max_p99 = series.iter().flat_map(|s| s.points.iter().filter_map(|p| p.2)).fold(1.0, f64::max) * 1.1;
    if series.iter().all(|s| s.points.is_empty()) {
        bail!("nothing to plot");
    }
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 22))?;
        let (left, right) = root.split_horizontally(w / 2);
        let panels: [(&DrawingArea<_, _>, &str, f64, bool); 2] =
            [(&left, "connections per second (higher is better)", max_cps, false), (&right, "p99 first-reply latency, µs (lower is better)", max_p99, true)];
        for (area, caption, ymax, is_lat) in panels {
            let mut chart = ChartBuilder::on(area)
                .caption(caption, ("sans-serif", 17))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d((0.8f64..max_n * 1.25).log_scale(), 0f64..ymax)?;
            chart
                .configure_mesh()
                .x_desc("Services")
                .x_label_formatter(&|x| format!("{x:.0}"))
                .y_label_formatter(&|y| format!("{y:.0}"))
                .label_style(("sans-serif", 13))
                .draw()?;
            for (i, s) in series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let pts: Vec<(f64, f64)> = s.points.iter().filter_map(|p| Some((p.0 as f64, if is_lat { p.2? } else { p.1 }))).collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                    .label(s.label.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(if is_lat { SeriesLabelPosition::UpperLeft } else { SeriesLabelPosition::LowerLeft })
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 13))
                .draw()?;
        }
        root.present()?;
    }
    let f = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(f), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(&buf)?;
    Ok(())
}
