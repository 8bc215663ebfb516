"""The rules an ``algorithm`` block must pass that relate its fields to each other, to the chosen
estimator's declarations (``rl.estimators``) and to the run's other blocks: one function,
``algorithm_problems(cfg)``, that the pre-start checks call (``rlhf_switch.problems``, check
``algorithm``). The pydantic types keep each field's form and range; these rules need more than one
field. Pure: no torch, nothing started.

- the estimator resolves (a user's ``module:Class`` imports and is an ``Estimator``);
- a field the chosen estimator does not read, given with a value other than its default, is
  refused, not ignored (a saved config repeats the defaults: those pass);
- what the estimator needs: a critic block (and none without), a reference block where the KL or
  the estimator asks for it, groups of at least 2 samples;
- DAPO's options fit: dynamic sampling needs a group estimator, the overlong buffer fits in
  ``max_new_tokens``;
- ``off_policy``: partial rollout needs a batch in flight, the masking band is a band;
- the algorithm's paper (``rl.choices.PAPER_RULES``; docs/algorithms.md): a value outside it is
  refused unless ``off_paper`` names the field, which may name only fields the paper fixes.
"""
from __future__ import annotations

from typing import Any

from .choices import PAPER_RULES, off_paper, shown
from .estimators import ESTIMATORS, estimator_class


def algorithm_problems(cfg: Any) -> list[str]:
    """Every problem of ``cfg.algorithm`` (a ``RunConfig``'s), one line each, prefixed by the
    field's path."""
    a = cfg.algorithm
    try:
        est = estimator_class(a.estimator)
    except ValueError as e:
        text = str(e)  # names the field itself where the import failed (rl.imports)
        return [text if text.startswith("algorithm.") else f"algorithm: {text}"]
    return (_unread_fields(a, est) + _needs(cfg, est) + _dapo_options(a, est) + _off_policy(a)
            + _paper(a))


def _unread_fields(a: Any, est: type) -> list[str]:
    reads = est.fields_read()
    problems = []
    for cls in ESTIMATORS.values():
        for field, (_, info) in cls.fields_read().items():
            if field in reads or not hasattr(a, field):
                continue
            value = getattr(a, field)
            if value != info.get_default(call_default_factory=True):
                readers = sorted(n for n, c in ESTIMATORS.items() if field in c.fields_read())
                line = (f"algorithm.{field}: the {', '.join(readers)} estimator's; {a.name} uses {est.name or a.estimator}, "
                        f"which does not read it")
                if line not in problems:
                    problems.append(line)
    return problems


def _needs(cfg: Any, est: type) -> list[str]:
    a = cfg.algorithm
    problems = []
    if est.critic and cfg.critic is None:
        problems.append(f"critic: {a.name}'s estimator ({est.name or a.estimator}) uses a critic: give a critic block "
                        f"(engine and layout of the value model)")
    if not est.critic and cfg.critic is not None:
        problems.append(f"critic: {a.name} has no critic (its estimator {est.name or a.estimator} uses none); remove "
                        f"the block")
    if (a.kl_coef > 0 or est.reference) and cfg.reference is None:
        why = f"algorithm.kl_coef={a.kl_coef}" if a.kl_coef > 0 else f"the {est.name or a.estimator} estimator"
        problems.append(f"reference: {why} needs a reference block" + (" (or set kl_coef: 0)" if a.kl_coef > 0 else ""))
    if est.groups and a.group_size < 2:
        problems.append(f"algorithm.group_size: {a.group_size} — the {est.name or a.estimator} estimator compares the "
                        f"samples of a prompt with each other: it needs group_size >= 2")
    return problems


def _dapo_options(a: Any, est: type) -> list[str]:
    problems = []
    if a.dynamic_sampling is not None and not est.groups:
        problems.append(f"algorithm.dynamic_sampling: drops groups whose samples all got the same reward; the "
                        f"{est.name or a.estimator} estimator does not work on groups")
    if a.overlong is not None and a.overlong.buffer_len > a.max_new_tokens:
        problems.append(f"algorithm.overlong.buffer_len: {a.overlong.buffer_len} is more than max_new_tokens="
                        f"{a.max_new_tokens}")
    return problems


def _off_policy(a: Any) -> list[str]:
    op = a.off_policy
    if op is None:
        return []
    problems = []
    if op.segment_tokens and not op.max_staleness:
        problems.append(f"algorithm.off_policy.segment_tokens: {op.segment_tokens} — partial rollout interrupts the "
                        f"batch in flight: max_staleness: 1")
    if op.low >= op.high:
        problems.append(f"algorithm.off_policy.low: {op.low} is not below high: {op.high} (the band ρ must fall in)")
    return problems


def _paper(a: Any) -> list[str]:
    """docs/algorithms.md's rule: a value that leaves the algorithm's paper is refused — every
    such field on its own line — unless ``off_paper`` names it."""
    rules = {r.field for r in PAPER_RULES.get(a.name, ())}
    unknown = [f for f in a.off_paper if f not in rules]
    if unknown:
        known = ", ".join(sorted(rules)) or "none: it fixes no field"
        return [f"algorithm.off_paper: {', '.join(unknown)} — not a setting {a.name}'s paper fixes "
                f"(those it fixes: {known})"]
    return [f"algorithm.{rule.field}: {shown(value)} — {a.name}'s paper has {rule.paper}; remove the field to take "
            f"{a.name}'s setting, or list it in algorithm.off_paper to keep yours"
            for rule, value in off_paper(a.name, a.values()) if rule.field not in a.off_paper]
