"""The paper's side of ``felix report``: a catalog of the paper's figures per experiment
(``configs/reports/felix.yaml`` by default; its header says what each kind of claim means), read
with a one-line error for anything malformed."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from felix.config import ConfigError, read_yaml
from felix.presets import CONFIG_DIR

DEFAULT_CATALOG = CONFIG_DIR / "reports" / "felix.yaml"
#: The weight the FeLiX paper's Fig. 15 argument counts updates above.
HIGH_WEIGHT = 0.8
_KINDS = ("speedup", "bytes_saving", "time_ratio", "weight_share", "diagnostic")


@dataclass(frozen=True)
class Claim:
    """One of the paper's figures for an experiment (see the catalog's header)."""

    kind: str
    subject: str
    baseline: str  # "" for a weight_share claim (the subject's own weights) and a diagnostic's own value
    source: str
    paper: float | None = None
    at_least: bool = False
    at_most: bool = False  # a weight_share claim's "fewer than"
    low: float | None = None
    high: float | None = None
    tolerance: float | None = None  # this claim's own, for a claim finer than the catalog's (5-7%)
    field: str = ""  # a diagnostic claim's run diagnostic (a key of summary.json's diagnostics)

    @property
    def label(self) -> str:
        kind = self.field if self.kind == "diagnostic" else self.kind.replace("_", " ")
        return f"{self.subject} vs {self.baseline} ({kind})" if self.baseline else f"{self.subject} ({kind})"

    def paper_text(self) -> str:
        if self.kind == "time_ratio":
            return f"{self.low:.2f}-{self.high:.2f}"
        if self.kind == "diagnostic" and self.paper is None:
            return f"{self.low:.3g}-{self.high:.3g}"
        if self.kind == "diagnostic":
            return f"{self.paper:.3g}"
        assert self.paper is not None
        if self.kind == "bytes_saving":
            return f"{self.paper:.0%} fewer"
        bound = ">" if self.at_least else "<" if self.at_most else ""
        if self.kind == "weight_share":
            return f"{bound}{self.paper:.0%} of updates weighted {HIGH_WEIGHT} or more"
        return f"{bound}{self.paper:.2f}x"


@dataclass(frozen=True)
class Experiment:
    """The paper's side of one experiment: which comparisons it covers and its claims."""

    match: tuple[str, ...]
    title: str
    section: str
    claims: tuple[Claim, ...]


@dataclass(frozen=True)
class Catalog:
    title: str
    paper: str
    tolerance: float
    experiments: tuple[Experiment, ...]

    def experiment(self, name: str) -> Experiment | None:
        """The first entry whose patterns match the comparison's name."""
        return next((e for e in self.experiments if any(fnmatch.fnmatch(name, m) for m in e.match)), None)


def load_catalog(path: Path) -> Catalog:
    """The paper's claims from ``path``; every error is one line that names the file."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such catalog of the paper's figures")
    doc = read_yaml(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("experiments"), list):
        raise ConfigError(f"{path}: a catalog needs 'experiments', a list of entries")
    experiments = []
    for i, e in enumerate(doc["experiments"]):
        where = f"{path}: experiments[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("match"), list) or not e.get("title"):
            raise ConfigError(f"{where}: needs 'match' (a list of name patterns) and 'title'")
        claims = []
        for j, c in enumerate(e.get("claims") or []):
            if not isinstance(c, dict):
                raise ConfigError(f"{where}.claims[{j}]: a claim is a mapping")
            if c.get("kind") in ("weight_share", "diagnostic"):
                c = {"baseline": "", **c}
            try:
                claim = Claim(**c)
            except TypeError as exc:
                raise ConfigError(f"{where}.claims[{j}]: {exc}") from None
            if claim.kind not in _KINDS:
                raise ConfigError(
                    f"{where}.claims[{j}]: kind must be one of {list(_KINDS)}, not {claim.kind!r}"
                )
            if claim.kind == "time_ratio" and (claim.low is None or claim.high is None):
                raise ConfigError(f"{where}.claims[{j}]: a time_ratio claim needs 'low' and 'high'")
            if claim.kind == "weight_share" and not (claim.at_least or claim.at_most):
                raise ConfigError(f"{where}.claims[{j}]: a weight_share claim needs at_least or at_most")
            ranged = claim.low is not None and claim.high is not None
            if claim.kind == "diagnostic" and not (claim.field and (ranged or claim.paper is not None)):
                raise ConfigError(
                    f"{where}.claims[{j}]: a diagnostic claim needs 'field' and 'paper' or 'low' and 'high'"
                )
            if claim.kind not in ("time_ratio", "diagnostic") and not isinstance(claim.paper, (int, float)):
                raise ConfigError(f"{where}.claims[{j}]: a {claim.kind} claim needs a number 'paper'")
            claims.append(claim)
        experiments.append(
            Experiment(
                tuple(str(m) for m in e["match"]), str(e["title"]), str(e.get("section", "")), tuple(claims)
            )
        )
    tol = doc.get("tolerance", 0.15)
    if not isinstance(tol, (int, float)) or not 0 <= tol < 1:
        raise ConfigError(f"{path}: tolerance must be a fraction in [0, 1), not {tol!r}")
    return Catalog(str(doc.get("title", "Report")), str(doc.get("paper", "")), float(tol), tuple(experiments))
