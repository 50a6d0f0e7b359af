"""What the file-taking commands (scan, rewrite) take from the project: its ``[tool.adopter]``
table (:mod:`adopter.core.project_config`), suppression comments and a baseline
(:mod:`adopter.core.suppress`), as one-line errors and warnings. Not a command
(``adopter.cli.COMMANDS`` lists those)."""

from __future__ import annotations

import os
import sys

from adopter.core.project_config import ConfigError, ProjectConfig, project_config
from adopter.core.suppress import Baseline, BaselineError, SiteFilter, parse_suppressions
from adopter.errors import UserError


def add_config_argument(parser) -> None:
    parser.add_argument("--config", metavar="PYPROJECT", default=None,
                        help="read [tool.adopter] from this file (default: the nearest pyproject.toml with a "
                             "[tool.adopter] table above the paths given; command-line flags win over it)")


def _canonical(names, where: str) -> list[str]:
    """Rule names as the registry spells them (any case given), or a one-line error."""
    from adopter.core.rules import rule_names

    known = {n.lower(): n for n in rule_names()}
    out = []
    for name in names:
        if name.lower() not in known:
            raise UserError(f"{where}: unknown rule {name!r}; known rules: {', '.join(rule_names())}")
        out.append(known[name.lower()])
    return out


def load_project(args, paths: list[str]) -> ProjectConfig:
    """The run's configuration, applied to ``args`` where the command line left a setting open:
    the rules (``select``/``ignore`` unless ``--rules``/``--rules-file``), ``--max-file-size`` and
    (rewrite) ``--torchscript``. Bad tables and unknown rule names: :class:`UserError`, exit 2."""
    try:
        config = project_config(paths, getattr(args, "config", None))
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    where = f"{config.path} [tool.adopter]"
    from adopter.core.rules import rule_names

    if config.select is not None or config.ignore:
        selected = _canonical(config.select, f"{where} select") if config.select is not None else rule_names()
        ignored = set(_canonical(config.ignore, f"{where} ignore"))
        if not (args.rules or args.rules_file):
            kept = [n for n in selected if n not in ignored]
            if not kept:
                raise UserError(f"{where}: select and ignore leave no rule")
            args.rules = ",".join(kept)
    for glob, rules in config.per_file_ignores:
        _canonical([r for r in rules if r != "*"], f"{where} per-file-ignores {glob!r}")
    if getattr(args, "max_file_size", None) is None and config.max_file_size is not None:
        args.max_file_size = config.max_file_size
    if hasattr(args, "torchscript") and args.torchscript is None:
        args.torchscript = config.torchscript or "auto"
    return config


def load_baseline(path: str | None) -> Baseline | None:
    if not path:
        return None
    try:
        return Baseline.load(path)
    except BaselineError as exc:
        raise UserError(str(exc)) from None


def site_filter(path: str, config: ProjectConfig, baseline: Baseline | None, record: bool = False) -> SiteFilter:
    """What a rewrite of ``path`` leaves alone (:class:`adopter.core.suppress.SiteFilter`)."""
    entries = tuple(sorted(baseline.for_file(path).items())) if baseline is not None else ()
    return SiteFilter(ignored_rules=config.ignored_rules(path), baseline=entries,
                      baseline_file=baseline.relative(path) if baseline is not None else "", record=record)


def warn_unknown_names(files: list[str], rules, stream=None) -> None:
    """``FILE:LINE: warning: ...`` for each rule name a suppression comment gives that no rule has
    (the comment suppresses nothing for it)."""
    from adopter.core.rules import rule_names

    stream = stream or sys.stderr
    known = set(rule_names()) | {getattr(r, "name", "") for r in rules}
    for path in files:
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            continue  # (the command reports it)
        if b"adopter" not in raw.lower():
            continue
        text = raw.decode("utf-8", "replace")
        for line, name in parse_suppressions(text).unknown_rules(known):
            stream.write(f"{path}:{line}: warning: unknown rule {name!r} in an `# adopter: ignore[...]` comment "
                         "(adopter rules lists them); it suppresses nothing\n")


def relative_to_cwd(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel
