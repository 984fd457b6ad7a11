"""`areal plot RUN [RUN ...]`: real runs (`areal run` of the RL doubles, eta 0 and eta 2) overlaid in a PNG whose
figure is read back, smoothing against a hand-computed moving average, the time axis, a TRL log, the errors, and
the `--html` page loaded in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from areal_cli.plot import build_figure, elapsed, label_runs, load_run, series
from areal_core.testing.waits import scaled

AREAL = str(Path(sys.executable).with_name("areal"))
CHROMIUM = Path("/usr/bin/chromium")
# Headless and quiet: without these Chromium reaches for the network (updates, sync, QUIC probes).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two real run folders, written by `areal run` (the RL doubles, 6 steps): trials eta0 and eta2."""
    from areal_core.testing.rl_doubles import areal_run

    folder = tmp_path_factory.mktemp("runs")
    made = {}
    for eta in (0, 2):
        proc, run_dir = areal_run(folder, f"eta{eta}", [f"rollout.max_head_offpolicyness={eta}"], timeout_s=300)
        assert proc.returncode == 0, proc.stdout
        made[f"eta{eta}"] = run_dir
    return made


def areal_plot(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([AREAL, "plot", *args], capture_output=True, text=True, timeout=scaled(120), cwd=cwd)


def figure_of(paths: list[Path], **options):
    """The figure `areal plot` draws for ``paths``, built by the same function."""
    loaded = [load_run(p) for p in paths]
    label_runs(loaded)
    return build_figure(loaded, **options), loaded


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_two_runs_give_one_png_whose_legend_names_both_trials(runs, tmp_path):
    out = tmp_path / "eta.png"
    proc = areal_plot(str(runs["eta0"]), str(runs["eta2"]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {out}"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["eta.png"]  # no temporary file left

    fig, _ = figure_of([runs["eta0"], runs["eta2"]])
    assert legend_texts(fig) == ["eta0", "eta2"]
    shown = [ax for ax in fig.axes if ax.get_visible()]  # a two-column grid hides the cell it does not fill
    titles = [ax.get_title() for ax in shown]
    assert titles == ["training reward (mean per step)", "loss", "completion length (tokens, mean)",
                      "generation tokens/s", "token staleness (versions, mean)"]
    assert fig.get_suptitle() == "areal plot: eta0, eta2 by step"
    for ax in shown:  # per run: the faint raw line, then the smoothed one, both in the run's color
        colors = [line.get_color() for line in ax.get_lines()]
        assert colors == ["C0", "C0", "C1", "C1"], (ax.get_title(), colors)
        assert [line.get_alpha() for line in ax.get_lines()] == [0.25, None, 0.25, None]
        assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_xticks()  # whole steps only
    staleness = shown[4].get_lines()
    assert max(staleness[1].get_ydata()) == 0  # eta 0 trains on fresh tokens only
    assert max(staleness[2].get_ydata()) > 0  # eta 2 on older ones too


def test_one_run_is_drawn_into_its_own_folder_as_before(runs):
    proc = areal_plot(str(runs["eta0"]))
    assert proc.returncode == 0, proc.stderr
    assert (runs["eta0"] / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoothing_is_tensorboards_debiased_moving_average(runs):
    rewards = [r["reward/mean"] for r in rows_of(runs["eta2"])]
    expected, last = [], 0.0  # by hand: last = 0.6 last + 0.4 v, shown as last / (1 - 0.6^n)
    for n, value in enumerate(rewards, 1):
        last = 0.6 * last + 0.4 * value
        expected.append(last / (1 - 0.6**n))
    fig, _ = figure_of([runs["eta2"]], smooth=0.6, metrics=["reward/mean"])
    raw, smooth = fig.axes[0].get_lines()
    assert list(raw.get_ydata()) == rewards
    assert list(smooth.get_ydata()) == pytest.approx(expected, rel=1e-12)
    assert smooth.get_ydata()[0] == rewards[0]  # debiased: the first point is the first value, not 0.4 of it

    fig, _ = figure_of([runs["eta2"]], smooth=0, metrics=["reward/mean"])
    (only,) = fig.axes[0].get_lines()  # --smooth 0: the raw line alone, fully drawn
    assert list(only.get_ydata()) == rewards and only.get_alpha() is None


def test_x_by_time_is_the_time_column_from_the_first_step_start(runs):
    rows = rows_of(runs["eta0"])
    origin = rows[0]["time"] - rows[0]["time/step_s"] - rows[0]["time/checkpoint_s"]
    fig, loaded = figure_of([runs["eta0"]], x="time", metrics=["reward/mean"])
    raw = fig.axes[0].get_lines()[0]
    # unix times are ~0.2 us apart as float64
    assert list(raw.get_xdata()) == pytest.approx([r["time"] - origin for r in rows], abs=1e-6)
    assert fig.axes[0].get_xlabel() == "training time (s)"
    assert loaded[0].resumes == []
    proc = areal_plot(str(runs["eta0"]), str(runs["eta2"]), "--x", "time", "--out", str(runs["eta0"] / "t.png"))
    assert proc.returncode == 0, proc.stderr


def test_a_stop_before_a_resume_is_left_out_of_the_time_axis(runs, tmp_path):
    """The same run as if stopped after step 3 and resumed two hours later (its records' own times kept)."""
    resumed = tmp_path / "areal" / "resumed"
    shutil.copytree(runs["eta0"], resumed, ignore=shutil.ignore_patterns("checkpoints", "weights", "tensorboard"))
    rows = rows_of(resumed)
    for row in rows[3:]:
        row["time"] += 7200
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    run = load_run(resumed)
    x = elapsed(run)
    own4 = rows[3]["time/step_s"] + rows[3]["time/checkpoint_s"]
    assert x[3] == pytest.approx(x[2] + own4)  # step 4 counts its own timings, not the 2 hours
    assert x[5] - x[3] == pytest.approx(rows[5]["time"] - rows[3]["time"])  # after the resume: the clock again
    assert run.resumes == [pytest.approx(x[2])]
    assert series(run, "reward/mean", "step")[0] == [1, 2, 3, 4, 5, 6]
    fig, _ = figure_of([resumed], x="time", metrics=["reward/mean"])
    assert "dotted: resumed" in fig.axes[0].get_xlabel()


def test_trials_of_the_same_name_are_told_apart_by_experiment(runs, tmp_path):
    other = tmp_path / "other-exp" / "eta0"
    shutil.copytree(runs["eta0"], other, ignore=shutil.ignore_patterns("checkpoints", "weights", "tensorboard"))
    config = (other / "config.yaml").read_text()
    (other / "config.yaml").write_text(config.replace("experiment: areal", "experiment: other-exp"))
    fig, _ = figure_of([runs["eta0"], other])
    assert legend_texts(fig) == ["areal/eta0", "other-exp/eta0"]


def trl_output(folder: Path, rewards: list[float]) -> Path:
    """A TRL GRPOTrainer output folder: checkpoint-N/trainer_state.json as transformers' TrainerState writes it
    (log_history: one entry per logging step, GRPO's keys, no wall-clock time; then the run's summary)."""
    history = [{"clip_ratio/region_mean": 0.0, "completions/mean_length": 11.0 + step, "epoch": step / 8,
                "frac_reward_zero_std": 0.5, "grad_norm": 0.01, "kl": 0.0, "learning_rate": 1e-5, "loss": 0.001,
                "num_tokens": 268.0 * step, "reward": reward, "reward_std": 0.3,
                "rewards/arithmetic_reward/mean": reward, "rewards/arithmetic_reward/std": 0.3, "step": step}
               for step, reward in enumerate(rewards, 1)]
    history.append({"epoch": len(rewards) / 8, "step": len(rewards), "total_flos": 0.0, "train_loss": 0.001,
                    "train_runtime": 31.5, "train_samples_per_second": 1.5, "train_steps_per_second": 0.19})
    state = {"best_global_step": None, "best_metric": None, "best_model_checkpoint": None,
             "epoch": len(rewards) / 8, "eval_steps": 500, "global_step": len(rewards),
             "is_hyper_param_search": False, "is_local_process_zero": True, "is_world_process_zero": True,
             "log_history": history, "logging_steps": 1, "max_steps": len(rewards), "num_input_tokens_seen": 0,
             "num_train_epochs": 1, "save_steps": len(rewards), "stateful_callbacks": {}, "total_flos": 0.0,
             "train_batch_size": 8, "trial_name": None, "trial_params": None}
    checkpoint = folder / f"checkpoint-{len(rewards)}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    return folder


def test_a_trl_log_is_drawn_beside_a_run_by_step_and_refused_by_time(runs, tmp_path):
    trl = trl_output(tmp_path / "trl-grpo", [0.1, 0.2, 0.4, 0.3, 0.5, 0.6])
    fig, _ = figure_of([runs["eta0"], trl], smooth=0, metrics=["reward/mean", "completions/mean_length"])
    assert legend_texts(fig) == ["eta0", "trl-grpo"]
    reward_lines = fig.axes[0].get_lines()
    assert list(reward_lines[1].get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(reward_lines[1].get_ydata()) == [0.1, 0.2, 0.4, 0.3, 0.5, 0.6]  # TRL's "reward"
    (length,) = fig.axes[1].get_lines()  # only TRL logs it
    assert length.get_color() == "C1"
    out = tmp_path / "vs.png"
    state = trl / "checkpoint-6" / "trainer_state.json"
    assert areal_plot(str(runs["eta0"]), str(state), "--out", str(out)).returncode == 0
    assert out.exists()

    out.unlink()
    proc = areal_plot(str(runs["eta0"]), str(trl), "--x", "time", "--out", str(out))
    assert proc.returncode == 1
    assert (f"{trl}: a TRL trainer_state.json records no wall-clock time, so it cannot be drawn against time. "
            f"Fix: --x step") in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("args, message", [
    (["{missing}"], "{missing} does not exist. Fix: pass the run folder"),
    (["{eta0}", "{empty}"], "{empty} has no metrics.jsonl. Fix: pass the run folder"),
    (["{eta0}", "--metrics", "reward/meen"], "--metrics: no run logs 'reward/meen'. Fix: use one of the logged "
                                              "keys, e.g. reward/mean"),
    (["{eta0}", "--smooth", "1"], "--smooth 1.0: the moving average's weight must be in [0, 1). Fix:"),
    (["{eta0}", "--x", "wall"], "--x 'wall' is not a choice. Fix: --x step, --x samples, --x tokens or --x time"),
    (["{eta0}", "--out", "{out}.jpg"], ".jpg is not a format areal plot writes. Fix: end it in .png, .svg, .pdf"),
])
def test_bad_input_is_named_with_its_fix_and_writes_nothing(runs, tmp_path, args, message):
    names = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "eta0": runs["eta0"],
             "out": tmp_path / "out" / "fig"}
    names["empty"].mkdir()
    (tmp_path / "out").mkdir()
    argv = [a.format(**names) for a in args]
    if "--out" not in argv:
        argv += ["--out", f"{names['out']}.png"]
    proc = areal_plot(*argv, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout
    assert message.format(**names) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_the_html_page_renders_both_runs_in_headless_chromium_offline(runs, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install 'areal-core[dev]' (playwright)")
    page_file = tmp_path / "eta.html"
    proc = areal_plot(str(runs["eta0"]), str(runs["eta2"]), "--html", "--x", "time", "--out", str(page_file))
    assert proc.returncode == 0, proc.stderr
    assert "<script src=" not in page_file.read_text()  # plotly.js inline

    problems, requests = [], []
    with sync_api.sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        browser = pw.chromium.launch_persistent_context(profile, executable_path=str(CHROMIUM), headless=True,
                                                        args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri(), wait_until="load", timeout=scaled(60) * 1000)
            page.wait_for_selector(".plotly-graph-div .scatterlayer .trace", timeout=scaled(60) * 1000)
            legend = page.eval_on_selector_all(".legend .legendtext", "els => els.map(e => e.textContent)")
            traces = page.eval_on_selector_all(".scatterlayer .trace path.js-line", "els => els.length")
            names = page.evaluate("() => document.querySelector('.plotly-graph-div').data.map(t => t.name)")
            tab = page.title()
        finally:
            browser.close()
    assert problems == []
    assert [u for u in requests if not u.startswith("file://")] == []  # opens from disk, no network
    assert legend == ["eta0", "eta2"]
    assert traces == 20  # 5 panels (reward, loss, length, generation tokens/s, staleness) x 2 runs x (raw + smoothed)
    assert tab == "areal plot: eta0, eta2 by time"  # the browser tab names what the page draws
    assert {"eta0", "eta2"} <= set(names)


def _seed_copy(run_dir: Path, folder: Path, seed: int, shift: float) -> Path:
    """``run_dir`` as if run with another trainer.seed: its config says so, and its rewards are ``shift`` higher."""
    import yaml

    shutil.copytree(run_dir, folder)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["trainer"]["seed"], config["trial"] = seed, f"{config['trial']}-s{seed}"
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    rows = rows_of(run_dir)
    for row in rows:
        if "reward/mean" in row:
            row["reward/mean"] += shift
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_seeds_of_one_configuration_are_drawn_as_their_mean_in_a_band(runs, tmp_path):
    from areal_cli.plot import group_seeds, panels_of

    seeds = [runs["eta2"], _seed_copy(runs["eta2"], tmp_path / "s7", 7, 0.1), _seed_copy(runs["eta2"], tmp_path / "s8",
                                                                                           8, 0.2)]
    loaded = group_seeds([load_run(p) for p in [*seeds, runs["eta0"]]])
    label_runs(loaded)
    assert [r.label for r in loaded] == ["eta2 (3 seeds)", "eta0"]  # eta 0 differs in more than the seed
    curve = next(c for c in panels_of(loaded, smooth=0, metrics=["reward/mean"])[0].curves if c.run.members)
    base = [r["reward/mean"] for r in rows_of(runs["eta2"]) if "reward/mean" in r]
    # each step: the mean of r, r + 0.1, r + 0.2 is r + 0.1, their sample standard deviation 0.1
    assert curve.raw == pytest.approx([r + 0.1 for r in base])
    assert curve.band[0] == pytest.approx([r for r in base]) and curve.band[1] == pytest.approx([r + 0.2 for r in base])
    done = areal_plot("--seeds", *map(str, seeds), str(runs["eta0"]), "--out", str(tmp_path / "seeds.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seeds.png").stat().st_size > 10_000
    refused = areal_plot("--seeds", str(runs["eta0"]), str(runs["eta2"]), "--out", str(tmp_path / "none.png"))
    assert refused.returncode == 1 and "--seeds: no two of these runs differ only in trainer.seed" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "none.png").exists()


def test_x_by_samples_and_tokens_is_the_running_sum_of_what_each_step_trained(runs, tmp_path):
    """--x samples / tokens: each point sits at the samples (trajectories) or tokens trained through its step,
    summed from the run's own train/samples and train/tokens; a TRL log is drawn by its num_tokens and refused
    by samples (it logs no count)."""
    rows = [r for r in rows_of(runs["eta0"]) if "train/samples" in r]
    assert rows and all(r["train/samples"] > 0 for r in rows)
    for by, key in (("samples", "train/samples"), ("tokens", "train/tokens")):
        fig, _ = figure_of([runs["eta0"]], x=by, smooth=0, metrics=["reward/mean"])
        (line,) = fig.axes[0].get_lines()
        expected, total = [], 0.0
        for r in rows:
            total += r[key]
            expected.append(total)
        assert list(line.get_xdata()) == expected
        assert by in fig.axes[0].get_xlabel()
    trl = trl_output(tmp_path / "trl", [0.1, 0.2, 0.3])
    proc = areal_plot(str(trl), "--x", "samples", "--out", str(tmp_path / "t.png"))
    assert proc.returncode == 1 and "records no sample count" in proc.stderr and "Fix: --x step" in proc.stderr
    fig, _ = figure_of([trl], x="tokens", smooth=0, metrics=["reward/mean"])
    (line,) = fig.axes[0].get_lines()
    assert list(line.get_xdata()) == [268.0, 536.0, 804.0]  # TRL's own cumulative num_tokens
