//! The plot and its PNG: decoded by an independent decoder, pixels where the data says.

mod support;

use sluice_report::{
    ACCURACY_COLOUR, Image, PanelKind, PlotOptions, REWARD_COLOUR, Rgb, Series, StepRecord,
    domain_colour, plot_run, render_run,
};
use support::{crc32, decode};

fn rgb(c: Rgb) -> [u8; 3] {
    [c.0, c.1, c.2]
}

/// A run whose reward (85–95 %) and accuracy (5–15 %) never come near each other, evaluated
/// every fifth step, with a phase change at step 10.
fn run(steps: u64) -> Vec<StepRecord> {
    (0..steps)
        .map(|step| StepRecord {
            step,
            wall_s: 2.5 * step as f64,
            phase: Some(if step < 10 { "sft" } else { "rl" }.to_string()),
            reward_mean: 0.85 + 0.1 * (step as f64 / steps as f64),
            eval_accuracy: step
                .is_multiple_of(5)
                .then(|| 0.05 + 0.1 * (step as f64 / steps as f64)),
            version_lag_mean: 1.0,
            ..StepRecord::default()
        })
        .collect()
}

#[test]
fn plot_png_decodes_to_the_rendered_pixels() {
    let plot = render_run(&run(40), &PlotOptions::default());
    let png = plot.image().to_png();
    let decoded = decode(&png).expect("valid PNG");
    assert_eq!((decoded.width, decoded.height), (960, 540));
    assert_eq!(decoded.chunks, [*b"IHDR", *b"IDAT", *b"IEND"]);
    assert_eq!(decoded.rgb, plot.image().rgb());
    // Mostly flat colour: the encoder's run-length matches must pay off.
    assert!(png.len() < 200_000, "{} bytes", png.len());
}

#[test]
fn a_corrupted_chunk_fails_its_crc() {
    let mut png = render_run(&run(5), &PlotOptions::default())
        .image()
        .to_png();
    // IHDR's CRC covers its type and data: recompute it independently, then flip an IDAT byte.
    assert_eq!(
        u32::from_be_bytes(png[29..33].try_into().unwrap()),
        crc32(&png[12..29])
    );
    png[45] ^= 0x40;
    let error = decode(&png).err().expect("corruption detected");
    assert!(error.contains("crc mismatch"), "{error}");
}

#[test]
fn noisy_and_tiny_images_round_trip() {
    // Noise forces literals; stripes force distance-3 and distance-1 matches across rows.
    let mut image = Image::new(97, 31, Rgb::WHITE);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for y in 0..31 {
        for x in 0..97 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let colour = if y % 3 == 0 {
                Rgb(10, 200, 30)
            } else {
                Rgb(state as u8, (state >> 8) as u8, (state >> 16) as u8)
            };
            if y % 5 != 1 {
                image.set(x, y, colour);
            }
        }
    }
    for image in [image, Image::new(1, 1, Rgb(1, 2, 3))] {
        let decoded = decode(&image.to_png()).expect("valid PNG");
        assert_eq!(
            (decoded.width, decoded.height),
            (image.width(), image.height())
        );
        assert_eq!(decoded.rgb, image.rgb());
    }
}

#[test]
fn plotted_lines_have_the_series_colours() {
    let records = run(40);
    let plot = render_run(&records, &PlotOptions::default());
    let decoded = decode(&plot.image().to_png()).unwrap();
    let near = |(x, y): (i32, i32), colour: Rgb| {
        (-1..=1).any(|dy| (-1..=1).any(|dx| decoded.pixel(x + dx, y + dy) == rgb(colour)))
    };
    for panel in [PanelKind::Step, PanelKind::WallTime] {
        let reward: Vec<(i32, i32)> = records
            .iter()
            .map(|r| plot.point(panel, Series::Reward, r).expect("finite reward"))
            .collect();
        for pair in reward.windows(2) {
            assert_eq!(
                decoded.pixel(pair[0].0, pair[0].1),
                rgb(REWARD_COLOUR),
                "{panel:?} {pair:?}"
            );
            let middle = ((pair[0].0 + pair[1].0) / 2, (pair[0].1 + pair[1].1) / 2);
            assert!(
                near(middle, REWARD_COLOUR),
                "{panel:?}: no reward line at {middle:?}"
            );
        }
        // The line rises: later steps are higher (smaller y) and further right.
        assert!(
            reward[39].0 > reward[0].0 && reward[39].1 < reward[0].1,
            "{reward:?}"
        );

        let evaluated: Vec<(i32, i32)> = records
            .iter()
            .filter_map(|r| plot.point(panel, Series::Accuracy, r))
            .collect();
        assert_eq!(evaluated.len(), 8);
        for point in &evaluated {
            // Each evaluated step is marked with a disc, not only crossed by the line.
            for (dx, dy) in [(0, 0), (-3, 0), (3, 0), (0, -3), (0, 3)] {
                assert_eq!(
                    decoded.pixel(point.0 + dx, point.1 + dy),
                    rgb(ACCURACY_COLOUR),
                    "{panel:?} {point:?}"
                );
            }
        }
        // Accuracy sits low on its 0–100 % axis, reward high on its 0–1 axis.
        assert!(
            evaluated
                .iter()
                .all(|a| reward.iter().all(|r| a.1 > r.1 + 50))
        );
    }
    assert_eq!(
        plot.point(PanelKind::Step, Series::Accuracy, &records[1]),
        None
    );
    // Step and wall time are proportional here, so both panels place points alike.
    let step = plot
        .point(PanelKind::Step, Series::Reward, &records[20])
        .unwrap();
    let wall = plot
        .point(PanelKind::WallTime, Series::Reward, &records[20])
        .unwrap();
    assert_eq!(step.1, wall.1);
    assert!(wall.0 > 480 && step.0 < 480);
}

/// A multi-domain run draws each domain's accuracy (`eval_accuracy.<domain>`) as its own thin
/// line, in its own colour, where its values say; a single-domain run draws none.
#[test]
fn each_domain_gets_its_own_accuracy_line() {
    let mut records = run(40);
    for r in &mut records {
        if r.eval_accuracy.is_some() {
            r.extra.insert("eval_accuracy.math".into(), 0.40);
            r.extra.insert("eval_accuracy.tools".into(), 0.70);
        }
    }
    let plot = render_run(&records, &PlotOptions::default());
    let decoded = decode(&plot.image().to_png()).unwrap();
    let near = |(x, y): (i32, i32), colour: Rgb| {
        (-1..=1).any(|dy| (-1..=1).any(|dx| decoded.pixel(x + dx, y + dy) == rgb(colour)))
    };
    for panel in [PanelKind::Step, PanelKind::WallTime] {
        for (i, domain) in ["math", "tools"].into_iter().enumerate() {
            let points: Vec<(i32, i32)> = records
                .iter()
                .filter_map(|r| plot.domain_point(panel, domain, r))
                .collect();
            assert_eq!(points.len(), 8, "{domain}");
            for pair in points.windows(2) {
                let middle = ((pair[0].0 + pair[1].0) / 2, (pair[0].1 + pair[1].1) / 2);
                assert!(
                    near(middle, domain_colour(i)),
                    "{panel:?}: no {domain} line at {middle:?}"
                );
            }
        }
        let math = plot.domain_point(panel, "math", &records[0]).unwrap();
        let tools = plot.domain_point(panel, "tools", &records[0]).unwrap();
        assert!(tools.1 < math.1, "70 % above 40 %");
    }
    let single = render_run(&run(40), &PlotOptions::default());
    let colours = single.image().rgb();
    let has = |c: Rgb| colours.chunks(3).any(|p| p == rgb(c));
    assert!(!has(domain_colour(0)) && !has(domain_colour(1)));
}

#[test]
fn rendering_is_deterministic() {
    let records = run(25);
    let a = render_run(&records, &PlotOptions::default())
        .image()
        .to_png();
    let b = render_run(&records, &PlotOptions::default())
        .image()
        .to_png();
    assert_eq!(a, b);
}

#[test]
fn empty_and_single_point_logs_plot() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.png");
    plot_run(&[], &empty).unwrap();
    let decoded = decode(&std::fs::read(&empty).unwrap()).unwrap();
    assert_eq!((decoded.width, decoded.height), (960, 540));
    assert_eq!(
        decoded.rgb,
        render_run(&[], &PlotOptions::default()).image().rgb()
    );

    let one = &run(1)[..];
    let path = dir.path().join("one.png");
    plot_run(one, &path).unwrap();
    let decoded = decode(&std::fs::read(&path).unwrap()).unwrap();
    let plot = render_run(one, &PlotOptions::default());
    assert_eq!(decoded.rgb, plot.image().rgb());
    for panel in [PanelKind::Step, PanelKind::WallTime] {
        let (x, y) = plot.point(panel, Series::Reward, &one[0]).unwrap();
        assert_eq!(decoded.pixel(x, y), rgb(REWARD_COLOUR), "{panel:?}");
        let (x, y) = plot.point(panel, Series::Accuracy, &one[0]).unwrap();
        assert_eq!(decoded.pixel(x, y), rgb(ACCURACY_COLOUR), "{panel:?}");
    }
}

#[test]
fn non_finite_values_and_odd_sizes_do_not_panic() {
    let mut records = run(12);
    records[3].reward_mean = f64::NAN;
    records[5].wall_s = f64::INFINITY;
    records[6].eval_accuracy = Some(f64::NAN);
    records[7].reward_mean = -40.0;
    for (width, height) in [(960, 540), (10, 10), (640, 360), (2000, 300)] {
        let plot = render_run(
            &records,
            &PlotOptions {
                width,
                height,
                title: Some("ablation: ppo (η = 4)".into()),
            },
        );
        assert!(plot.image().width() >= 320 && plot.image().height() >= 200);
        assert_eq!(
            plot.point(PanelKind::Step, Series::Reward, &records[3]),
            None
        );
        assert_eq!(
            plot.point(PanelKind::WallTime, Series::Reward, &records[5]),
            None
        );
        assert!(
            plot.point(PanelKind::Step, Series::Reward, &records[5])
                .is_some()
        );
        decode(&plot.image().to_png()).unwrap();
    }
}

/// A log with response lengths, group times and mismatch gets a second row of three panels: the
/// trained mean is drawn below the generated mean (it is shorter), the engine share below the
/// whole group time, later steps further right, every point inside the image and below the first
/// row's panels; the same log without those keys keeps the one-row layout.
#[test]
fn lengths_and_mismatch_get_a_second_row() {
    use sluice_report::keys as k;
    let plain = run(20);
    let mut records = plain.clone();
    for r in &mut records {
        let s = r.step as f64;
        r.extra.insert(k::LENGTH_GENERATED_MEAN.into(), 400.0 + s);
        r.extra.insert(k::LENGTH_TRAINED_MEAN.into(), 300.0 + s);
        r.extra.insert(k::LENGTH_BIAS.into(), -0.2);
        r.extra
            .insert(k::MISMATCH_LOGPROB_ABS_MEAN.into(), 1e-3 * (1.0 + s));
        r.extra.insert(k::MISMATCH_KL.into(), 1e-5);
        r.extra.insert(k::TIME_GROUP_SECONDS.into(), 2.0 + 0.1 * s);
        r.extra.insert(k::TIME_ENGINE_SECONDS.into(), 1.0);
        r.extra.insert(k::TIME_ENV_SECONDS.into(), 0.2);
        r.extra.insert(k::TRUNCATED_RATIO.into(), 0.1);
    }
    let with = render_run(&records, &PlotOptions::default());
    let without = render_run(&plain, &PlotOptions::default());
    assert!(
        without
            .diagnostic_point(k::LENGTH_TRAINED_MEAN, &plain[3])
            .is_none()
    );
    let first_row_bottom = records
        .iter()
        .filter_map(|r| with.point(PanelKind::Step, Series::Reward, r))
        .map(|p| p.1)
        .max()
        .unwrap();
    for r in &records {
        let generated = with.diagnostic_point(k::LENGTH_GENERATED_MEAN, r).unwrap();
        let trained = with.diagnostic_point(k::LENGTH_TRAINED_MEAN, r).unwrap();
        let mismatch = with
            .diagnostic_point(k::MISMATCH_LOGPROB_ABS_MEAN, r)
            .unwrap();
        let group = with.diagnostic_point(k::TIME_GROUP_SECONDS, r).unwrap();
        let engine = with.diagnostic_point(k::TIME_ENGINE_SECONDS, r).unwrap();
        assert!(trained.1 > generated.1, "{trained:?} {generated:?}");
        assert!(generated.1 > first_row_bottom && generated.1 < 540);
        assert!(engine.1 > group.1, "{engine:?} {group:?}");
        assert!(
            generated.0 < group.0 && group.0 < mismatch.0,
            "lengths, times, mismatch from left to right: {generated:?} {group:?} {mismatch:?}"
        );
        assert!(mismatch.0 > 480, "the mismatch panel is the right one");
    }
    let a = with
        .diagnostic_point(k::MISMATCH_LOGPROB_ABS_MEAN, &records[0])
        .unwrap();
    let b = with
        .diagnostic_point(k::MISMATCH_LOGPROB_ABS_MEAN, &records[19])
        .unwrap();
    assert!(b.0 > a.0 && b.1 < a.1, "{a:?} {b:?}");
    // The one-row plot is drawn as before: the reward points of the step panel sit lower.
    let r = &plain[10];
    assert!(
        without.point(PanelKind::Step, Series::Reward, r).unwrap().1
            > with.point(PanelKind::Step, Series::Reward, r).unwrap().1
    );
}
