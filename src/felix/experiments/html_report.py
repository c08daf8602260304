"""``felix report DIR...``: comparison folders as one self-contained HTML page, ours beside the paper's.

Each DIR is a folder ``felix compare`` wrote (``comparison.json`` and ``manifest.json``). For each
one the page shows the time and bytes to every target (mean ± std over seeds) as a table and an
embedded plot (a server-lr grid: its tuning table instead of the time and diagnostics plots), the paper's figures for that experiment (from a catalog of the paper's claims,
``configs/reports/felix.yaml`` by default) against ours with a flag where they differ by more
than the catalog's tolerance, and the command that regenerates the folder. A dp-* folder (variants
``<strategy>-eps<e>``) also gets the price of privacy (``felix.experiments.price_of_privacy``);
``--catalog privacy`` titles a page of such folders without the paper's figures. Plots are PNGs
embedded as base64, so the page reads offline and can be committed as one file.

Our side of a claim is computed from the folder's per-target statistics: a speed-up is the
baseline's mean time to the target over the subject's (the ratio of means, so that any pair of
variants can be read, not only pairs with the comparison's reference), a bytes saving is one
minus the ratio of the mean bytes. A claim holds when the paper's value lies within the
tolerance of our range over the targets (for a lower bound: our largest value reaches it).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from felix.config import ConfigError
from felix.experiments.paper_catalog import DEFAULT_CATALOG, HIGH_WEIGHT, Catalog, Claim, load_catalog
from felix.experiments.price_of_privacy import (
    Grid,
    Table,
    accuracy_points,
    accuracy_table,
    grid,
    is_private_comparison,
    noise_table,
    paired_table,
    time_table,
)
from felix.experiments.result_folder import (
    DIAGNOSTICS,
    Folder,
    UpdateWeights,
    best_point,
    combine_folders,
    lr_grid,
    raw_weights,
    read_folder,
    run_diagnostics,
)

COMMAND = "report"


@dataclass(frozen=True)
class Verdict:
    """Our side of one claim: the value at each target (None: a side never reached it)."""

    claim: Claim
    ours: dict[float, float | None]
    status: str  # "agrees", "differs", "not measured"

    def ours_text(self) -> str:
        def one(v: float | None) -> str:
            if v is None:
                return "n.r."
            if self.claim.kind == "bytes_saving":
                return f"{v:.0%}" if v >= 0 else f"{-v:.0%} more"
            if self.claim.kind == "weight_share" or self.claim.field.endswith("share"):
                return f"{v:.1%}" if self.claim.kind == "diagnostic" else f"{v:.0%}"
            if self.claim.kind == "diagnostic":
                return f"{v:.3g}"
            return f"{v:.2f}" + ("x" if self.claim.kind == "speedup" else "")

        return " / ".join(one(v) for v in self.ours.values())


def judge(folder: Folder, claim: Claim, tolerance: float) -> Verdict:
    """Our value of ``claim`` at each target of ``folder`` and whether the paper's lies in range
    (a weight_share claim: one value, the seeds' mean share, against the paper's bound)."""
    if claim.kind == "weight_share":
        return _judge_share(folder, claim, tolerance)
    if claim.kind == "diagnostic":
        return _judge_diagnostic(folder, claim, tolerance)
    ours: dict[float, float | None] = {}
    for t in folder.targets:
        key = "bytes_total" if claim.kind == "bytes_saving" else "time_s"
        a, b = folder.mean(claim.subject, t, key), folder.mean(claim.baseline, t, key)
        if a is None or b is None or a <= 0 or b <= 0:
            ours[t] = None
        elif claim.kind == "speedup":
            ours[t] = b / a
        elif claim.kind == "bytes_saving":
            ours[t] = 1.0 - a / b
        else:
            ours[t] = a / b
    values = [v for v in ours.values() if v is not None]
    if claim.subject not in folder.stats or claim.baseline not in folder.stats or not values:
        return Verdict(claim, ours, "not measured")
    lo, hi = min(values), max(values)
    tolerance = claim.tolerance if claim.tolerance is not None else tolerance
    if claim.kind == "time_ratio":
        assert claim.low is not None and claim.high is not None
        ok = hi >= claim.low * (1 - tolerance) and lo <= claim.high * (1 + tolerance)
    elif claim.kind == "bytes_saving":
        assert claim.paper is not None
        ok = lo - tolerance <= claim.paper <= hi + tolerance
    elif claim.at_least:
        assert claim.paper is not None
        ok = hi >= claim.paper * (1 - tolerance)
    else:
        assert claim.paper is not None
        ok = lo * (1 - tolerance) <= claim.paper <= hi * (1 + tolerance)
    return Verdict(claim, ours, "agrees" if ok else "differs")


def _judge_share(folder: Folder, claim: Claim, tolerance: float) -> Verdict:
    weights = raw_weights(folder).get(claim.subject)
    if weights is None or not weights.share_high:
        return Verdict(claim, {HIGH_WEIGHT: None}, "not measured")
    share = sum(weights.share_high) / len(weights.share_high)
    assert claim.paper is not None
    tolerance = claim.tolerance if claim.tolerance is not None else tolerance
    ok = share >= claim.paper - tolerance if claim.at_least else share <= claim.paper + tolerance
    return Verdict(claim, {HIGH_WEIGHT: share}, "agrees" if ok else "differs")


def _judge_diagnostic(folder: Folder, claim: Claim, tolerance: float) -> Verdict:
    """A run diagnostic over the whole run: the subject's seed-mean, or with a baseline the ratio
    of the two seed-means, against the paper's value or range (relative tolerance)."""
    diag = run_diagnostics(folder)

    def mean(variant: str) -> float | None:
        values = diag.get(variant, {}).get(claim.field)
        return sum(values) / len(values) if values else None

    a = mean(claim.subject)
    b = mean(claim.baseline) if claim.baseline else 1.0
    if a is None or not b:
        return Verdict(claim, {0.0: None}, "not measured")
    ours = a / b
    tolerance = claim.tolerance if claim.tolerance is not None else tolerance
    if claim.paper is None:
        assert claim.low is not None and claim.high is not None
        ok = claim.low * (1 - tolerance) <= ours <= claim.high * (1 + tolerance)
    else:
        ok = abs(ours - claim.paper) <= tolerance * abs(claim.paper)
    return Verdict(claim, {0.0: ours}, "agrees" if ok else "differs")


def _png(fig: Any, colors: int = 16) -> str:
    """``fig`` as a base64 PNG of at most ``colors`` colours: a plot's few flat colours and their
    antialiased edges need no more, and the page, which embeds every plot (over 170 for the FeLiX
    report), stays under 2 MB. 16 keeps lines told apart by colour (32 made that page 2.1 MB instead
    of 1.9, 256 about 2.7 MB); bars in three colours read the same at 8, bars in one at 4 (which
    takes a diagnostics plot from 11 to 7 kB)."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    buf.seek(0)
    with Image.open(buf) as img:
        small = img.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    small.save(out, format="png", optimize=True)
    return base64.b64encode(out.getvalue()).decode("ascii")


def time_plot(folder: Folder) -> str:
    """Mean time to each target per variant, std error bars; base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(folder.stats)
    width = 0.8 / max(1, len(folder.targets))
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, key, scale, label in (
        (axes[0], "time_s", 1.0, "virtual time to target (s)"),
        (axes[1], "bytes_total", 1e6, "MB to target"),
    ):
        for j, t in enumerate(folder.targets):
            xs = [i + (j - (len(folder.targets) - 1) / 2) * width for i in range(len(names))]
            means, errs = [], []
            for n in names:
                s = folder.spread(n, t, key) or {}
                means.append((s.get("mean") or 0.0) / scale)
                errs.append((s.get("std") or 0.0) / scale)
            ax.bar(xs, means, width, yerr=errs, capsize=2, label=f"target {t:g}")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    axes[0].set_title("mean ± std over seeds (0 = not reached)", fontsize=8)
    fig.tight_layout()
    out = _png(fig, colors=8)
    plt.close(fig)
    return out


def claims_plot(verdicts: Sequence[Verdict]) -> str | None:
    """The paper's value beside ours (our range over the targets as the error bar); base64 PNG."""
    shown = [
        v
        for v in verdicts
        if v.claim.kind not in ("bytes_saving", "weight_share", "diagnostic")
        and any(x is not None for x in v.ours.values())
    ]
    if not shown:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(shown)))
    for i, v in enumerate(shown):
        vals = [x for x in v.ours.values() if x is not None]
        mid = sorted(vals)[len(vals) // 2]
        if v.claim.kind == "time_ratio":
            assert v.claim.low is not None and v.claim.high is not None
            paper = (v.claim.low + v.claim.high) / 2
        else:
            assert v.claim.paper is not None
            paper = v.claim.paper
        ax.barh(i + 0.2, paper, 0.38, color="#999999", label="paper" if i == 0 else None)
        ax.barh(
            i - 0.2,
            mid,
            0.38,
            xerr=[[mid - min(vals)], [max(vals) - mid]],
            capsize=3,
            color="#3b7dd8" if v.status == "agrees" else "#d8643b",
            label="ours (range over targets)" if i == 0 else None,
        )
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(
        range(len(shown)),
        [v.claim.label for v in shown],
        fontsize=8,
    )
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlabel("speed-up (x) or time ratio; orange: differs from the paper")
    fig.tight_layout()
    out = _png(fig)
    plt.close(fig)
    return out


def weights_plot(weights: dict[str, UpdateWeights]) -> str:
    """The update weights' distribution of each variant: the share of updates with a weight of
    at most w (the cumulative distribution, mean of the seeds' percentiles) where the runs
    recorded it, else the 5th-95th percentile range with the median marked; base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(1.6, max(w.percentiles[-1] if w.percentiles else w.p95 for w in weights.values()) * 1.05)
    if all(w.percentiles for w in weights.values()):
        fig, ax = plt.subplots(figsize=(8, 3.6))
        share = [i / 100 for i in range(101)]
        for name, w in weights.items():
            ax.step(list(w.percentiles), share, where="post", label=name)
        ax.set_ylabel("share of updates with weight <= w")
        ax.set_ylim(0, 1.01)
        ax.legend(fontsize=8, loc="upper left")
        ax.set_xlabel(f"update weight w_i; dashed: {HIGH_WEIGHT}")
    else:
        fig, ax = plt.subplots(figsize=(8, 0.7 + 0.45 * len(weights)))
        for i, w in enumerate(weights.values()):
            ax.plot([w.p5, w.p95], [i, i], lw=6, color="#3b7dd8", solid_capstyle="butt")
            ax.plot([w.p50], [i], "k|", ms=14, mew=2)
        ax.set_yticks(range(len(weights)), list(weights), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"update weight w_i: 5th-95th percentile (bar), median (|); dashed: {HIGH_WEIGHT}")
    ax.axvline(HIGH_WEIGHT, color="#b3391a", lw=0.8, ls="--")
    ax.set_xlim(0, top)
    fig.tight_layout()
    out = _png(fig)
    plt.close(fig)
    return out


def epsilon_plot(g: Grid) -> str:
    """The last evaluation's accuracy against epsilon, a line per strategy (mean over seeds,
    sd error bars; epsilon on a log axis, "no DP" at the right); base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [float(e) for e in g.epsilons if e != "inf"]
    x_inf = 2 * max(finite) if finite else 1.0
    fig, ax = plt.subplots(figsize=(7, 3.4))
    markers = "osD^vP*X"  # the page's 16 colours merge near hues: a marker per strategy tells them apart
    for i, (s, points) in enumerate(accuracy_points(g).items()):
        xs = [x_inf if e == "inf" else float(e) for e, _ in points]
        stats = [_mean_std(acc) for _, acc in points]
        ax.errorbar(
            xs,
            [m for m, _ in stats],
            yerr=[d for _, d in stats],
            marker=markers[i % len(markers)],
            ls=("-", "--", ":")[i // len(markers) % 3],
            capsize=3,
            label=s,
        )
    ticks = finite + ([x_inf] if "inf" in g.epsilons else [])
    ax.set_xscale("log")
    ax.set_xticks(ticks, [f"{t:g}" for t in finite] + (["no DP"] if "inf" in g.epsilons else []))
    ax.minorticks_off()
    ax.set_xlabel("epsilon (delta as configured)")
    ax.set_ylabel("accuracy, last evaluation")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out = _png(fig)
    plt.close(fig)
    return out


def _html_table(t: Table) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in t.header)
    rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in t.rows)
    return f"<table><tr>{head}</tr>{rows}</table>"


def privacy_section(f: Folder) -> list[str]:
    """A dp-* comparison's price of privacy (``felix.experiments.price_of_privacy``): accuracy
    against epsilon (table and plot), time to each target per epsilon, the noise multipliers and
    epsilon spent, and felix's paired lead; nothing for a folder without private variants."""
    if not is_private_comparison(f.runs):
        return []
    e = html.escape
    g = grid(f.runs)
    window = f.target_window
    out = [
        "<h3>The price of privacy</h3>",
        (
            "<p class='small'>Variants <code>&lt;strategy&gt;-eps&lt;e&gt;</code>; no DP is the same "
            "orchestration without privacy. Accuracy of the last evaluation, mean ± sd over seeds (ε: "
            "the largest any seed spent); a private run stops when its budget is spent.</p>"
        ),
        _html_table(accuracy_table(g)),
        f"<img alt='accuracy against epsilon, {e(f.name)}' src='data:image/png;base64,{epsilon_plot(g)}'>",
    ]
    for t in f.targets:
        rule = f" (mean of the last {window} evaluations)" if window else ""
        out.append(
            f"<p class='small'>Virtual seconds to {t:g}{e(rule)}, mean ± sd over the seeds that reached it.</p>"
        )
        out.append(_html_table(time_table(g, f.stats, f"{t:g}")))
    out.append(
        "<p class='small'>The noise multipliers (σ: the updates'; the reports': the losses and "
        "utilities clients send, noised on the device under <code>privacy.reports</code>) and the "
        "epsilon the runs spent.</p>"
    )
    out.append(_html_table(noise_table(g)))
    if "felix" in g.strategies:
        out.append(
            "<p class='small'>felix's last-evaluation accuracy minus each strategy's, paired by seed "
            "(mean [min..max]).</p>"
        )
        out.append(_html_table(paired_table(g)))
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)


def diagnostics_table(diag: dict[str, dict[str, list[float]]], seeds: int) -> str:
    """The run diagnostics per variant, mean ± std over the seeds (HTML rows)."""
    e = html.escape
    keys = [(k, label) for k, label in DIAGNOSTICS if any(k in d for d in diag.values())]
    rows = ["<table><tr><th>variant</th>" + "".join(f"<th>{e(label)}</th>" for _, label in keys) + "</tr>"]
    for name, d in diag.items():
        cells = []
        for k, _ in keys:
            if k not in d:
                cells.append("<td>-</td>")
                continue
            mean, std = _mean_std(d[k])
            pct = k.endswith("share")
            txt = f"{mean:.1%} ± {std:.1%}" if pct else f"{mean:.3g} ± {std:.2g}"
            if len(d[k]) < seeds:
                txt += f" ({len(d[k])}/{seeds} seeds)"
            cells.append(f"<td>{e(txt)}</td>")
        rows.append(f"<tr><td>{e(name)}</td>{''.join(cells)}</tr>")
    return "".join(rows) + "</table>"


def diagnostics_plot(diag: dict[str, dict[str, list[float]]]) -> str:
    """One panel per diagnostic, three to a row, a bar per variant (mean over seeds, std error bars);
    base64 PNG in 4 colours (one bar colour, black, white and their edges)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(k, label) for k, label in DIAGNOSTICS if any(k in d for d in diag.values())]
    cols = min(3, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols, 0.9 + 0.3 * len(diag) * nrows), squeeze=False)
    names = list(diag)
    for ax, (k, label) in zip(axes.flat, keys, strict=False):
        stats = [_mean_std(diag[n][k]) if k in diag[n] else (0.0, 0.0) for n in names]
        ax.barh(
            range(len(names)), [m for m, _ in stats], xerr=[s for _, s in stats], capsize=2, color="#3b7dd8"
        )
        ax.set_yticks(range(len(names)), names if ax in axes[:, 0] else [""] * len(names), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.locator_params(axis="x", nbins=4)  # a third of the width: 0.0025-wide labels would collide
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    out = _png(fig, colors=4)
    plt.close(fig)
    return out


def regenerate_command(folder: Folder) -> str:
    """The command that made the folder, with its output folder written as OUT."""
    cmd = [str(c) for c in folder.manifest.get("command") or []]
    if not cmd:
        return f"felix compare {folder.name} --out OUT"
    if cmd[0].endswith("felix") or cmd[0].endswith("__main__.py"):
        cmd[0] = "felix"
    for i, c in enumerate(cmd[:-1]):
        if c == "--out":
            cmd[i + 1] = "OUT"
    return " ".join(c if c and all(ch.isalnum() or ch in "-_.=/,:" for ch in c) else f"'{c}'" for c in cmd)


def provenance_text(folder: Folder) -> str:
    p = folder.manifest.get("provenance") or {}
    git = p.get("git") or {}
    bits = [
        f"commit {str(git.get('commit', '?'))[:10]}" + (" (dirty)" if git.get("dirty") else ""),
        f"torch {p.get('torch', '?')}",
        f"{p.get('cpu', '?')} ({p.get('torch_cpu_capability', '?')} kernels)",
        f"run threads {folder.manifest.get('threads', '?')}",
        f"{folder.manifest.get('started_utc', '?')} to {folder.manifest.get('ended_utc', '?')}",
    ]
    return ", ".join(bits)


def _fmt_spread(s: dict[str, Any] | None, scale: float = 1.0, digits: int = 0) -> str:
    if not s or s.get("mean") is None:
        return "not reached"
    mean, std = s["mean"] / scale, (s.get("std") or 0.0) / scale
    txt = f"{mean:.{digits}f} ± {std:.{digits}f}" if not math.isnan(std) else f"{mean:.{digits}f}"
    if s.get("n", 0) < s.get("of", 0):
        txt += f" ({s['n']}/{s['of']} reached)"
    return txt


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1250px;
color:#222;line-height:1.4;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.25em;border-top:2px solid #ddd;padding-top:1em;margin-top:2em}
table{border-collapse:collapse;font-size:0.85em;margin:0.6em 0}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f2f2f2}
td:first-child,th:first-child{text-align:left}
code,pre{background:#f6f6f6;padding:2px 4px;font-size:0.85em}pre{padding:8px;overflow-x:auto}
.agrees{color:#1a6e1a;font-weight:600}.differs{color:#b3391a;font-weight:600}.not{color:#777}
.small{font-size:0.8em;color:#555}img{max-width:100%}
"""


def render(folders: Sequence[Folder], catalog: Catalog) -> str:
    """The whole page."""
    e = html.escape
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{e(catalog.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(catalog.title)}</h1><p>{e(catalog.paper)}</p>",
    ]
    claims = any(x.claims for x in catalog.experiments)  # a catalog without the paper's figures: no verdicts
    if claims:
        parts.append(
            f"<p class='small'>A claim <span class='agrees'>agrees</span> when the paper's value lies within "
            f"{catalog.tolerance:.0%} of our range over the targets (for the paper's lower bounds: our largest "
            "value reaches it), else it <span class='differs'>differs</span>. Speed-up = the baseline's mean "
            "time to the target / the subject's; bytes saving = 1 - the subject's mean bytes / the baseline's.</p>"
        )
    summary: list[tuple[Folder, Verdict]] = []
    body: list[str] = []
    for f in folders:
        exp = catalog.experiment(f.name)
        verdicts = [judge(f, c, catalog.tolerance) for c in exp.claims] if exp else []
        summary += [(f, v) for v in verdicts]
        body.append(f"<h2 id='{e(f.name)}'>{e(f.name)}" + (f": {e(exp.title)}" if exp else "") + "</h2>")
        body.append(f"<p>{e(f.description)}</p>")
        if f.ran_on():
            body.append(f"<p><b>Trained:</b> {e(f.ran_on())} (dataset / model)</p>")
        body.append(f"<p><b>Regenerate:</b> <code>{e(regenerate_command(f))}</code><br>")
        body.append(
            f"<span class='small'>Seeds {e(str(f.seeds))}; reference {e(f.reference)}; made at "
            f"{e(provenance_text(f))}.</span></p>"
        )
        for part in f.more:
            body.append(
                f"<p><b>Then, replacing the variants it holds ({e(', '.join(part.runs))}):</b> "
                f"<code>{e(regenerate_command(part))}</code><br><span class='small'>made at "
                f"{e(provenance_text(part))}.</span></p>"
            )
        if exp and not exp.claims:
            body.append(
                f"<p class='not'>The paper ({e(exp.section)}) gives no figure to set beside these.</p>"
            )
        elif exp:
            body.append(f"<h3>The paper ({e(exp.section)}) beside ours</h3>")
            body.append(
                "<table><tr><th>claim</th><th>paper</th><th>source</th><th>ours at "
                + " / ".join(f"{t:g}" for t in f.targets)
                + (
                    " (a weight share or a run diagnostic: over the run)"
                    if any(v.claim.kind in ("weight_share", "diagnostic") for v in verdicts)
                    else ""
                )
                + "</th><th></th></tr>"
            )
            for v in verdicts:
                cls = "not" if v.status == "not measured" else v.status
                body.append(
                    f"<tr><td>{e(v.claim.label)}</td><td>{e(v.claim.paper_text())}</td><td>{e(v.claim.source)}</td>"
                    f"<td>{e(v.ours_text())}</td><td class='{cls}'>{e(v.status)}</td></tr>"
                )
            body.append("</table>")
            img = claims_plot(verdicts)
            if img:
                body.append(
                    f"<img alt='the paper against ours, {e(f.name)}' src='data:image/png;base64,{img}'>"
                )
        else:
            body.append("<p class='not'>The catalog has no figure of the paper for this comparison.</p>")
        body += privacy_section(f)
        weights = raw_weights(f)
        if weights:
            body.append("<h3>Update weights (the paper's Fig. 15 argument)</h3>")
            body.append(
                "<p class='small'>The paper (§6.3, Fig. 15): TierFuse gives weights of 0.8 or more to over 90% "
                "of the updates, a FedBuff-style policy to fewer than 10%, typically about 0.5. Ours: the "
                "weights of the async variants that divide by the buffer size (5th / 50th / 95th percentile "
                "over every aggregated update, mean over seeds; the share weighted 0.8 or more, mean ± std "
                "over seeds, where the runs recorded every percentile).</p><table><tr><th>variant</th>"
                "<th>p5</th><th>median</th><th>p95</th><th>share with w &ge; 0.8</th></tr>"
            )
            for name, w in weights.items():
                body.append(
                    f"<tr><td>{e(name)}</td><td>{w.p5:.2f}</td><td>{w.p50:.2f}</td><td>{w.p95:.2f}</td>"
                    f"<td>{e(w.share_text)}</td></tr>"
                )
            body.append("</table>")
            body.append(
                f"<img alt='update weights, {e(f.name)}' src='data:image/png;base64,{weights_plot(weights)}'>"
            )
        grid = lr_grid(f)  # a tuning grid: its tables rank the settings; a bar per grid point is unreadable
        diag = run_diagnostics(f)
        if diag:
            body.append("<h3>Run diagnostics (mean ± std over seeds)</h3>")
            body.append(
                "<p class='small'>Time between consecutive model versions; the aggregator's stall (virtual "
                "time in which no training task holds a slot, as a share of the run and per interval "
                "between versions); staleness (versions behind, per applied update); the age of the "
                "picked client's utility at selection (rounds since it was measured); the share of "
                "training selections that lost their slot mid-task. Definitions: docs/architecture.md, "
                "run diagnostics.</p>"
            )
            body.append(diagnostics_table(diag, len(f.seeds)))
            if not grid:
                body.append(
                    f"<img alt='run diagnostics, {e(f.name)}' src='data:image/png;base64,{diagnostics_plot(diag)}'>"
                )
        if grid:
            lrs = sorted({p.lr for points in grid.values() for p in points})
            body.append("<h3>Server learning rate grid (tuning criterion)</h3>")
            body.append(
                "<p class='small'>Per strategy and server lr: the mean over "
                + " / ".join(f"{t:g}" for t in f.targets)
                + " of the seed-mean time to the target (s), a seed that missed a target counted at its "
                "run's max time, with how many (seed, target) pairs missed; bold: the chosen lr (lowest "
                "criterion, ties by bytes).</p>"
            )
            body.append(
                "<table><tr><th>strategy</th>"
                + "".join(f"<th>lr {lr:g}</th>" for lr in lrs)
                + "<th>chosen</th></tr>"
            )
            for family, points in grid.items():
                best, by_lr = best_point(points), {p.lr: p for p in points}
                row: list[str] = []
                for lr in lrs:
                    p = by_lr.get(lr)
                    if p is None:
                        row.append("<td>-</td>")
                        continue
                    txt = f"{p.score:.0f}" + (f" ({p.missed}/{p.runs} missed)" if p.missed else "")
                    row.append(f"<td><b>{e(txt)}</b></td>" if p is best else f"<td>{e(txt)}</td>")
                body.append(f"<tr><td>{e(family)}</td>{''.join(row)}<td>{best.lr:g}</td></tr>")
            body.append("</table>")
        body.append("<h3>Ours: time and bytes to each target (mean ± std over seeds)</h3>")
        head = "".join(f"<th>time to {t:g} (s)</th><th>MB to {t:g}</th>" for t in f.targets)
        body.append(f"<table><tr><th>variant</th>{head}</tr>")
        for name in f.stats:
            cells = "".join(
                f"<td>{e(_fmt_spread(f.spread(name, t, 'time_s')))}</td>"
                f"<td>{e(_fmt_spread(f.spread(name, t, 'bytes_total'), 1e6))}</td>"
                for t in f.targets
            )
            body.append(f"<tr><td>{e(name)}</td>{cells}</tr>")
        body.append("</table>")
        if not grid:
            body.append(
                f"<img alt='time and bytes to target, {e(f.name)}' src='data:image/png;base64,{time_plot(f)}'>"
            )
    if claims:
        parts.append(
            "<h2>Summary: every claim</h2><table><tr><th>comparison</th><th>claim</th><th>paper</th>"
        )
        parts.append("<th>ours (per target)</th><th></th></tr>")
        for f, v in summary:
            cls = "not" if v.status == "not measured" else v.status
            parts.append(
                f"<tr><td><a href='#{e(f.name)}'>{e(f.name)}</a></td><td>{e(v.claim.label)}</td>"
                f"<td>{e(v.claim.paper_text())}</td>"
                f"<td>{e(v.ours_text())}</td><td class='{cls}'>{e(v.status)}</td></tr>"
            )
        parts.append("</table>")
    parts += body
    parts.append("</body></html>\n")
    return "\n".join(parts)


def report(dirs: Sequence[Path], out: Path, catalog_path: Path = DEFAULT_CATALOG) -> Path:
    """Read ``dirs``, write the page to ``out`` and return it."""
    if not dirs:
        raise ConfigError("felix report: give at least one comparison folder")
    catalog = load_catalog(catalog_path)
    folders = combine_folders([read_folder(Path(d)) for d in dirs])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(folders, catalog))
    return out


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="folders written by felix compare; parts of one comparison (the same name) read as one, a later part's "
        "variants replacing the earlier's",
    )
    p.add_argument("--out", default="report.html", help="the HTML page to write (default report.html)")
    p.add_argument(
        "--catalog",
        help="YAML of the paper's figures per experiment, or the name of a shipped one in configs/reports/ "
        "(default: felix, the FeLiX paper's; privacy: the dp-* comparisons' page)",
    )
    p.set_defaults(func=run)


def catalog_path(value: str | None) -> Path:
    """``--catalog``: a file, else the shipped catalog of that name (``configs/reports/<name>.yaml``)."""
    if value is None:
        return DEFAULT_CATALOG
    shipped = DEFAULT_CATALOG.parent / f"{value}.yaml"
    return shipped if not Path(value).is_file() and shipped.is_file() else Path(value)


def run(args: argparse.Namespace) -> int:
    out = report([Path(d) for d in args.dirs], Path(args.out), catalog_path(args.catalog))
    print(f"felix report: {len(args.dirs)} comparison(s) -> {out}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``felix report`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        COMMAND,
        help="comparison folders as one offline HTML page, ours beside the paper's",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m felix.experiments.html_report``)."""
    p = argparse.ArgumentParser(prog="python -m felix.experiments.html_report", description=__doc__)
    _configure(p)
    try:
        return run(p.parse_args(argv))
    except ConfigError as exc:
        print(f"felix report: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
