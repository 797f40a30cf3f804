"""The plan: a default site spec and ordered glob rules over site names (:class:`Plan`)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from numscope._atomic import atomic_write_text
from numscope._names import exact_pattern
from numscope.formats.spec import BlockFormat, get_format
from numscope.plan.files import _plan_parts, _site_to_dict, _StrictLoader
from numscope.plan.presets import _PRESETS
from numscope.plan.spec import (
    DEFAULT_PATTERN,
    HIGH,
    PLAN_VERSION,
    VERSION_KEY,
    OperandSpec,
    PlanError,
    PlanRow,
    Rule,
    SiteSpec,
    _names,
    _operand_spec,
    _reasons,
    _split_key,
    _type_name,
    _unknown,
)
from numscope.vocab import OPERAND_KEYS

_NAMED_RECIPES: dict[str, Any] = {}
"""The field's named recipes by name (each with ``needs_sites``), registered by :mod:`numscope.plan.recipes`
(:func:`register_recipes`) when :mod:`numscope.plan` is imported: this module needs nothing above it."""
_RECIPE_BUILDER: list[Any] = []


def register_recipes(recipes: Mapping[str, Any], build: Any) -> None:
    """Make ``recipes`` (name → recipe with ``needs_sites``) and their builder ``build(name, sites)`` what
    :meth:`Plan.recipes`, :meth:`Plan.recipe`, :meth:`Plan.named`, :meth:`Plan.resolve` and
    :meth:`Plan.needs_sites` know."""
    _NAMED_RECIPES.clear()
    _NAMED_RECIPES.update(recipes)
    _RECIPE_BUILDER[:] = [build]


@dataclass(frozen=True)
class Plan:
    """A precision plan: a default site spec and glob rules over site names (immutable, hashable).

    :meth:`for_site` returns the spec of the **last** rule whose pattern matches the site name, else
    ``default``; a matching rule's spec is used whole (operands it does not set are ``high``). Patterns are
    ``fnmatch`` globs, case-sensitive, matched against the whole name: ``*`` matches any run of characters,
    dots included (``*.attention.self.*`` matches every attention projection of every layer), ``?`` one
    character, ``[0-3]`` a character set. Put broad rules first and exceptions after them.

    source: the file the plan was loaded from (for error messages only; ignored by ``==`` and ``hash``).
    """

    default: SiteSpec = field(default_factory=SiteSpec)
    rules: tuple[Rule, ...] = ()
    default_reasons: Mapping[str, str] = field(default_factory=dict)
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.default, SiteSpec):
            raise PlanError(f"the default is a SiteSpec, got {_type_name(self.default)}")
        rules = tuple(self.rules)
        for index, rule in enumerate(rules):
            if not isinstance(rule, Rule):
                raise PlanError(f"rules[{index}] must be a Rule, got {_type_name(rule)}")
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "default_reasons", _reasons(self.default_reasons))

    # -- lookup -----------------------------------------------------------------------------------
    def rule_for(self, site_name: str) -> Rule | None:
        """The rule that decides ``site_name`` (the last one that matches), or ``None`` for the default."""
        for rule in reversed(self.rules):
            if rule.matches(site_name):
                return rule
        return None

    def for_site(self, site_name: str) -> SiteSpec:
        """The numerics of the site called ``site_name``: the last matching rule's spec, else the default."""
        rule = self.rule_for(site_name)
        return self.default if rule is None else rule.spec

    def check_sites(self, site_names: Iterable[str]) -> None:
        """Raise :class:`PlanError` naming every rule pattern that matches none of ``site_names``."""
        names = list(site_names)
        unmatched = []
        for index, rule in enumerate(self.rules):
            if rule.optional or any(rule.matches(name) for name in names):
                continue
            inside = [name for name in names if name.startswith(rule.pattern + ".")]
            close = difflib.get_close_matches(rule.pattern, names, n=2, cutoff=0.6)
            if inside:  # a module whose GEMMs run under names of their own (a matmul in its forward)
                hint = f" (the module's GEMMs run as {_names(repr(c) for c in inside[:3])}: name those)"
            else:
                hint = f" (closest: {_names(repr(c) for c in close)})" if close else ""
            unmatched.append(f"rules[{index}].match {rule.pattern!r}{hint}")
        if not unmatched:
            return
        shown = names[:5]
        more = f", … ({len(names) - len(shown)} more)" if len(names) > len(shown) else ""
        available = f"{_names(shown)}{more}" if names else "none (the model has no sites)"
        prefix = f"{self.source}: " if self.source else ""
        raise PlanError(
            f"{prefix}{len(unmatched)} pattern(s) match no site: {'; '.join(unmatched)}. "
            f"Sites ({len(names)}): {available}"
        )

    # -- derived views ----------------------------------------------------------------------------
    def describe(self) -> list[PlanRow]:
        """One row per operand of the default and of each rule, in plan order, ``high`` operands included."""
        rows = []
        entries = [(DEFAULT_PATTERN, self.default, self.default_reasons)]
        entries += [(rule.pattern, rule.spec, rule.reasons) for rule in self.rules]
        for pattern, spec, reasons in entries:
            for gemm, operand in OPERAND_KEYS:
                op = spec.operand(gemm, operand)
                rows.append(
                    PlanRow(
                        pattern,
                        gemm,
                        operand,
                        op.format,
                        op.describe_scaling(),
                        reasons.get(f"{gemm}/{operand}", ""),
                        "-" if op.is_high else op.rounding,
                        spec.accumulate_for(gemm),
                    )
                )
        return rows

    def uses_block_formats(self) -> bool:
        """Whether any operand is in a block format (MX, NVFP4): where numscope's compiled quantizers
        (:func:`numscope.formats.set_fast`) repay their compilation; element casts run as fast eagerly."""
        return any(
            row.format != HIGH and isinstance(get_format(row.format), BlockFormat) for row in self.describe()
        )

    def average_bits(
        self, site_sizes: Mapping[str, Mapping[tuple[str, str], int]], high_bits: float = 32.0
    ) -> float:
        """Average storage bits per operand element over the given sites, weighted by element counts.

        site_sizes: site name → ``(gemm, operand)`` → number of elements of that operand (e.g. from one
            step's shapes). Block-scale overhead is included (:meth:`OperandSpec.bits_per_element`);
            ``high`` operands count as ``high_bits`` (32 by default, e.g. 16 for a bf16 model).
        """
        total_bits = 0.0
        total_elements = 0
        for site_name, sizes in site_sizes.items():
            spec = self.for_site(site_name)
            for key, count in sizes.items():
                gemm, operand = _split_key(key)
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise PlanError(
                        f"element count of {site_name}/{gemm}/{operand} must be an int >= 0, got {count!r}"
                    )
                total_bits += count * spec.operand(gemm, operand).bits_per_element(high_bits)
                total_elements += count
        if total_elements == 0:
            raise PlanError("average_bits needs at least one operand element; site_sizes holds none")
        return total_bits / total_elements

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def per_operand(
        cls,
        formats: Mapping[tuple[str, str, str], str | OperandSpec],
        reasons: Mapping[tuple[str, str, str], str] | None = None,
        accumulate: Mapping[str, str | Mapping[str, str]] | None = None,
    ) -> Plan:
        """A plan giving each ``(site, gemm, operand)`` its format (a name, or an :class:`OperandSpec` with
        its scaling and rounding), one exact-name rule per site (glob characters in names escaped); operands
        and sites not listed stay high. ``reasons`` go to the rules; ``accumulate``: a site's accumulation
        (see :class:`SiteSpec`), fp32 where not given."""
        per_site: dict[str, dict[tuple[str, str], OperandSpec]] = {}
        for (site, gemm, operand), label in formats.items():
            spec = label if isinstance(label, OperandSpec) else OperandSpec(label)
            per_site.setdefault(site, {})[(gemm, operand)] = spec
        reasons = reasons or {}
        rules = tuple(
            Rule(
                exact_pattern(site),
                SiteSpec(specs, (accumulate or {}).get(site, "fp32")),
                {f"{g}/{o}": reasons[(site, g, o)] for g, o in specs if (site, g, o) in reasons},
            )
            for site, specs in per_site.items()
        )
        return cls(SiteSpec(), rules)

    def with_rule(
        self,
        pattern: str,
        spec: SiteSpec,
        reasons: Mapping[str, str] | None = None,
        optional: bool = False,
    ) -> Plan:
        """A new plan with a rule appended (it takes precedence over every earlier rule)."""
        rule = Rule(pattern, spec, reasons or {}, optional)
        return Plan(self.default, (*self.rules, rule), self.default_reasons)

    def with_default(self, spec: SiteSpec, reasons: Mapping[str, str] | None = None) -> Plan:
        """A new plan with another default site spec."""
        return Plan(spec, self.rules, reasons or {})

    def with_high_as(self, spec: OperandSpec | str) -> Plan:
        """The plan with every operand it leaves high given ``spec`` instead, in its default and every rule
        (accumulation, reasons and patterns kept): e.g. ``OperandSpec("bf16", overflow="propagate")`` for
        what a training stack runs in its autocast dtype around the GEMMs its recipe quantizes."""
        given = _operand_spec(spec)
        if given.is_high:
            return self

        def filled(site: SiteSpec) -> SiteSpec:
            return SiteSpec({key: site.operand(*key) if key in site.operands else given
                             for key in OPERAND_KEYS}, site.accumulate)  # fmt: skip

        rules = tuple(Rule(r.pattern, filled(r.spec), r.reasons, r.optional) for r in self.rules)
        return Plan(filled(self.default), rules, self.default_reasons, self.source)

    @staticmethod
    def presets() -> tuple[str, ...]:
        """The names :meth:`uniform` knows."""
        return tuple(_PRESETS)

    @staticmethod
    def recipes() -> tuple[str, ...]:
        """The names :meth:`recipe` knows (the field's published recipes: :mod:`numscope.plan.recipes`)."""
        return tuple(_NAMED_RECIPES)

    @classmethod
    def recipe(cls, name: str, sites: Iterable[str] | None = None) -> Plan:
        """A named recipe of the field as a plan (``numscope recipes`` lists them with their sources).

        sites: the model's site names, for the recipes whose layer choice depends on the model (NVFP4's
        last ~15% of linear layers in BF16); without them such a choice is left out, as the recipe's
        notes say.
        """
        if not _RECIPE_BUILDER:
            raise PlanError("no named recipes are registered: import numscope.plan")
        return _RECIPE_BUILDER[0](name, sites)

    @classmethod
    def named(cls, name: str, sites: Iterable[str] | None = None) -> Plan:
        """A preset (:meth:`uniform`) or a named recipe (:meth:`recipe`, given ``sites``) by its name."""
        if isinstance(name, str) and name in _PRESETS:
            return cls.uniform(name)
        if isinstance(name, str) and name in cls.recipes():
            return cls.recipe(name, sites)
        raise PlanError(_unknown("preset or recipe", str(name), (*_PRESETS, *cls.recipes())))

    @classmethod
    def resolve(cls, spec: str | os.PathLike[str], sites: Iterable[str] | None = None) -> Plan:
        """The plan a ``--plan`` value names: a YAML file (a ``.yaml``/``.yml`` name, or any file that
        exists), else a preset or named recipe (:meth:`named`, given the model's ``sites`` where a recipe's
        layer choice needs them; a folder that happens to bear its name, such as a run's ``--out fp32``,
        does not hide it). The one rule every entry point reads plans by; PlanError says what was wrong and
        what is allowed."""
        path = Path(spec)
        named = str(spec) in _PRESETS or str(spec) in cls.recipes()
        if path.suffix in (".yaml", ".yml") or path.is_file() or (path.exists() and not named):
            if not path.is_file():
                raise PlanError(
                    f"`plan` {spec}: no such file (or give a preset: {', '.join(_PRESETS)}; or a recipe: "
                    f"{', '.join(cls.recipes())})"
                )
            if path.suffix not in (".yaml", ".yml"):
                raise PlanError(f"`plan` {spec}: a plan file must be YAML (.yaml or .yml)")
            try:
                return cls.load(path)
            except (OSError, UnicodeDecodeError) as error:
                raise PlanError(f"`plan` {spec}: cannot read it ({error})") from error
        return cls.named(str(spec), sites)

    @classmethod
    def needs_sites(cls, spec: str | os.PathLike[str]) -> bool:
        """Whether :meth:`resolve` of ``spec`` depends on the model's sites: a named recipe whose layer choice
        does (a plan file or a preset never does), so that it is resolved once, with the model's sites."""
        path = Path(spec)
        if path.suffix in (".yaml", ".yml") or path.is_file() or str(spec) in _PRESETS:
            return False
        found = _NAMED_RECIPES.get(str(spec))
        return found is not None and found.needs_sites

    @classmethod
    def uniform(cls, name: str) -> Plan:
        """A preset plan: one site spec for every site, accumulation in fp32.

        ===========  =========================================================================================
        preset       every site
        ===========  =========================================================================================
        fp32         every operand ``high`` (unquantized): a converted fp32 model equals the original
        bf16         every operand ``bf16``, element cast, no scaling
        fp16         every operand ``fp16``, element cast, no scaling (loss scaling is the LossScaler's job)
        fp8          Transformer Engine's ``Format.HYBRID`` with current (per-tensor) scaling, as
                     ``Float8CurrentScaling``: ``fp8_e4m3`` for fprop input and weight, dgrad weight and
                     wgrad input; ``fp8_e5m2`` for grad_output in dgrad and wgrad
        fp8_e4m3     every operand ``fp8_e4m3``, per-tensor current scaling (TE ``Format.E4M3``)
        mxfp8        every operand ``mxfp8_e4m3`` (32 × E4M3, E8M0 scale, OCP floor rule), gradients included
        mxfp6        every operand ``mxfp6_e3m2`` (32 × E3M2, E8M0 scale)
        mxfp4        every operand ``mxfp4_e2m1`` (32 × E2M1, E8M0 scale)
        nvfp4        every operand ``nvfp4`` (16 × E2M1, E4M3 block scale, fp32 tensor scale), nearest
        int8         every operand ``int8``, per-tensor current scaling
        e5m2_grads   grad_output (dgrad and wgrad) in ``fp8_e5m2`` with no scaling, overflowing to inf; the
                     other operands ``high``: the 2018 paper's loss-scaling experiment one step below fp16
        ===========  =========================================================================================

        Block formats' blocks run along each GEMM's contraction axis (set by the runtime).
        """
        builder = _PRESETS.get(name) if isinstance(name, str) else None
        if builder is None:
            raise PlanError(_unknown("preset", str(name), _PRESETS))
        return cls(builder())

    # -- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The YAML shape (plain dicts, lists, strings); :meth:`from_dict` reads it back to an equal plan."""
        out: dict[str, Any] = {VERSION_KEY: PLAN_VERSION}
        out["default"] = _site_to_dict(self.default, self.default_reasons, always_accumulate=True)
        rules = []
        for rule in self.rules:
            optional = {"optional": True} if rule.optional else {}
            rules.append({"match": rule.pattern, **optional, **_site_to_dict(rule.spec, rule.reasons)})
        if rules:
            out["rules"] = rules
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> Plan:
        """Read and validate the YAML shape; errors name ``source`` (a file name), the key path and what
        is allowed."""
        try:
            default, rules, reasons = _plan_parts(data)
            return cls(default, rules, reasons, source=source)
        except PlanError as error:
            if source is None:
                raise
            raise PlanError(f"{source}: {error}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str], site_names: Iterable[str] | None = None) -> Plan:
        """Read a plan file; with ``site_names``, also check that every rule pattern matches a site."""
        source = os.fspath(path)
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
        except PlanError as error:
            raise PlanError(f"{source}: {error}") from None
        except yaml.YAMLError as error:
            raise PlanError(f"{source}: not valid YAML: {error}") from None
        plan = cls.from_dict(data, source)
        if site_names is not None:
            plan.check_sites(site_names)
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as YAML, atomically: a temporary file in the same folder, then ``os.replace``."""
        target = Path(path)
        text = "# numscope precision plan (see numscope.plan for the keys)\n" + yaml.safe_dump(
            self.to_dict(), sort_keys=False, default_flow_style=None, width=110, allow_unicode=True
        )
        atomic_write_text(target, text)
