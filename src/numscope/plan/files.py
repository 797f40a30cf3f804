"""Plan files: the YAML shape written by :meth:`Plan.save` and read, strictly, by :meth:`Plan.load`."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import yaml

from numscope.formats.scaling import KINDS, Scaling
from numscope.formats.spec import get_format
from numscope.plan.spec import (
    _A_TYPE,
    _GROUP_KEYS,
    _OPERAND_DEFAULTS,
    _OPERAND_FIELDS,
    _ROLE_KEYS,
    _SCALING_TYPES,
    ACCUMULATE,
    HIGH,
    PLAN_VERSION,
    VERSION_KEY,
    OperandSpec,
    PlanError,
    Rule,
    SiteSpec,
    _FrozenDict,
    _names,
    _reasons,
    _split_key,
    _type_name,
    _unknown,
)
from numscope.vocab import GEMMS, OPERAND_KEYS, OPERANDS

# -- YAML shape: writing --------------------------------------------------------------------------------


def _operand_to_value(spec: OperandSpec) -> str | dict[str, Any]:
    extra: dict[str, Any] = {}
    if spec.scaling is not None:
        scaling = spec.scaling.to_dict()
        extra["scaling"] = scaling["kind"] if len(scaling) == 1 else scaling
    for name in ("rounding", "overflow", "flush_subnormals", "transform"):
        if getattr(spec, name) != _OPERAND_DEFAULTS[name]:
            extra[name] = getattr(spec, name)
    return {"format": spec.format, **extra} if extra else spec.format


def _site_to_dict(
    spec: SiteSpec, reasons: Mapping[str, str], always_accumulate: bool = False
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    values = [spec.operand(g, o) for g, o in OPERAND_KEYS]
    if all(v == values[0] for v in values):
        out["all"] = _operand_to_value(values[0])
    else:
        for gemm in GEMMS:
            out[gemm] = {o: _operand_to_value(spec.operand(gemm, o)) for o in OPERANDS[gemm]}
    if always_accumulate or spec.accumulate != "fp32":
        out["accumulate"] = spec.accumulate if isinstance(spec.accumulate, str) else dict(spec.accumulate)
    if reasons:
        out["reasons"] = dict(reasons)
    return out


# -- YAML shape: reading --------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that rejects duplicate keys instead of keeping the last one silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise PlanError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _at(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _expect_mapping(value: Any, where: str, what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise PlanError(f"{where} must be a mapping ({what}), got {_type_name(value)}")
    for key in value:
        if not isinstance(key, str):
            raise PlanError(f"{where}: keys must be strings, got {_type_name(key)} {key!r}")
    return value


def _parse_scaling(value: Any, where: str) -> Scaling:
    if isinstance(value, str):
        if value not in KINDS:
            raise PlanError(f"{where}: {_unknown('scaling kind', value, KINDS)}")
        return Scaling(value)  # type: ignore[arg-type]
    data = _expect_mapping(value, where, "a kind name or Scaling fields")
    for key in data:
        if key == "axis":
            raise PlanError(
                f"{_at(where, key)}: axis is not a plan setting (the runtime uses the GEMM's "
                "contraction axis); drop it"
            )
        if key not in _SCALING_TYPES:
            raise PlanError(f"{where}: {_unknown('scaling key', key, _SCALING_TYPES)}")
    if "kind" not in data:
        raise PlanError(f"{where}: missing key 'kind'; allowed kinds: {_names(KINDS)}")
    for key, expected in _SCALING_TYPES.items():
        if key not in data:
            continue
        item = data[key]
        accepted = (int, float) if expected is float else expected  # YAML writes 0.0 as 0 only if asked
        wrong = not isinstance(item, accepted) or (expected in (int, float) and isinstance(item, bool))
        if wrong:
            raise PlanError(f"{_at(where, key)} must be {_A_TYPE[expected]}, got {_type_name(item)}")
    if data["kind"] not in KINDS:
        raise PlanError(f"{_at(where, 'kind')}: {_unknown('scaling kind', data['kind'], KINDS)}")
    try:
        return Scaling.parse(dict(data))  # type: ignore[return-value]
    except (TypeError, ValueError) as error:
        raise PlanError(f"{where}: {error}") from None


def _parse_operand(value: Any, where: str) -> OperandSpec:
    if isinstance(value, str):
        data: Mapping[str, Any] = {"format": value}
    elif isinstance(value, Mapping):
        data = _expect_mapping(value, where, "an operand spec")
        for key in data:
            if key not in _OPERAND_FIELDS:
                raise PlanError(f"{where}: {_unknown('operand spec key', key, _OPERAND_FIELDS)}")
        if "format" not in data:
            raise PlanError(f"{where}: missing key 'format' (a format name or 'high')")
    else:
        raise PlanError(f"{where} must be a format name or a mapping with 'format', got {_type_name(value)}")
    args: dict[str, Any] = {}
    for key in _OPERAND_FIELDS:
        if key not in data:
            continue
        item = data[key]
        if key == "scaling":
            args[key] = _parse_scaling(item, _at(where, key))
            continue
        expected = bool if key == "flush_subnormals" else str
        if key == "transform" and item is None:
            continue
        if not isinstance(item, expected):
            raise PlanError(f"{_at(where, key)} must be {_A_TYPE[expected]}, got {_type_name(item)}")
        args[key] = item
    fmt_where = where if isinstance(value, str) else _at(where, "format")
    if args["format"].strip().lower() != HIGH:
        try:
            get_format(args["format"])
        except ValueError as error:
            raise PlanError(f"{fmt_where}: {error}") from None
    try:
        return OperandSpec(**args)
    except PlanError as error:
        raise PlanError(f"{where}: {error}") from None


def _is_operand_value(value: Any) -> bool:
    """A GEMM entry that is one spec for both operands (a name, or a mapping with 'format')."""
    return isinstance(value, str) or (isinstance(value, Mapping) and "format" in value)


def _parse_site(data: Mapping[str, Any], where: str, extra_keys: tuple[str, ...]) -> tuple[SiteSpec, Any]:
    site_keys = ("all", *_GROUP_KEYS, *_ROLE_KEYS, *GEMMS)
    allowed = (*extra_keys, *site_keys, "accumulate", "reasons")
    for key in data:
        if key not in allowed:
            raise PlanError(f"{where}: {_unknown('key', key, allowed)}")
    operands: dict[tuple[str, str], OperandSpec] = {}
    if "all" in data:
        spec = _parse_operand(data["all"], _at(where, "all"))
        operands.update(dict.fromkeys(OPERAND_KEYS, spec))
    for group, gemms in _GROUP_KEYS.items():
        if group in data:
            spec = _parse_operand(data[group], _at(where, group))
            operands.update({(g, o): spec for g in gemms for o in OPERANDS[g]})
    for role in _ROLE_KEYS:
        if role in data:
            spec = _parse_operand(data[role], _at(where, role))
            operands.update({(g, o): spec for g, o in OPERAND_KEYS if o == role})
    for gemm in GEMMS:
        if gemm not in data:
            continue
        gemm_where, value = _at(where, gemm), data[gemm]
        if _is_operand_value(value):
            spec = _parse_operand(value, gemm_where)
            operands.update({(gemm, o): spec for o in OPERANDS[gemm]})
            continue
        entries = _expect_mapping(value, gemm_where, f"operand -> spec, operands: {_names(OPERANDS[gemm])}")
        for operand, item in entries.items():
            if operand not in OPERANDS[gemm]:
                raise PlanError(
                    f"{gemm_where}: unknown operand {operand!r}; allowed for {gemm}: {_names(OPERANDS[gemm])}"
                )
            operands[(gemm, operand)] = _parse_operand(item, _at(gemm_where, operand))
    accumulate = data.get("accumulate", "fp32")
    if isinstance(accumulate, Mapping):
        for gemm, name in accumulate.items():
            if gemm not in GEMMS:
                raise PlanError(f"{_at(where, 'accumulate')}: {_unknown('gemm', str(gemm), GEMMS)}")
            if not isinstance(name, str) or name not in ACCUMULATE:
                raise PlanError(
                    f"{_at(_at(where, 'accumulate'), gemm)}: {_unknown('accumulate', str(name), ACCUMULATE)}"
                )
    elif not isinstance(accumulate, str):
        raise PlanError(
            f"{_at(where, 'accumulate')} must be a name or a mapping gemm -> name, "
            f"got {_type_name(accumulate)}"
        )
    elif accumulate not in ACCUMULATE:
        raise PlanError(f"{_at(where, 'accumulate')}: {_unknown('accumulate', accumulate, ACCUMULATE)}")
    return SiteSpec(operands, accumulate), _parse_reasons(data.get("reasons", {}), _at(where, "reasons"))


def _parse_reasons(value: Any, where: str) -> _FrozenDict:
    reasons = _expect_mapping(value, where, "'gemm/operand' -> text")
    for key, text in reasons.items():
        try:
            _split_key(key)
        except PlanError as error:
            raise PlanError(f"{where}: {error}") from None
        if not isinstance(text, str):
            raise PlanError(f"{_at(where, key)} must be a string, got {_type_name(text)}")
    return _reasons(reasons)


def _plan_parts(data: Any) -> tuple[SiteSpec, tuple[Rule, ...], _FrozenDict]:
    """A plan file's parsed mapping as the parts of a :class:`numscope.plan.Plan`: its default site spec,
    its rules and the default's reasons (PlanError naming the key where the file is wrong)."""
    if data is None:
        raise PlanError(f"the plan is empty; a plan starts with '{VERSION_KEY}: {PLAN_VERSION}'")
    data = _expect_mapping(data, "the plan", f"top-level keys {VERSION_KEY}, default, rules")
    allowed = (VERSION_KEY, "default", "rules")
    for key in data:
        if key not in allowed:
            raise PlanError(_unknown("top-level key", key, allowed))
    if VERSION_KEY not in data:
        raise PlanError(
            f"missing version key '{VERSION_KEY}' (this numscope reads plan version {PLAN_VERSION}); "
            f"start the file with '{VERSION_KEY}: {PLAN_VERSION}'"
        )
    version = data[VERSION_KEY]
    if isinstance(version, bool) or not isinstance(version, int):
        raise PlanError(f"{VERSION_KEY} must be an int, got {_type_name(version)}")
    if version > PLAN_VERSION:
        raise PlanError(
            f"plan version {version} is newer than this numscope reads ({PLAN_VERSION}); upgrade numscope"
        )
    if version < 1:
        raise PlanError(f"unknown plan version {version}; this numscope reads version {PLAN_VERSION}")
    default, default_reasons = SiteSpec(), _FrozenDict()
    if "default" in data:
        default_data = _expect_mapping(data["default"], "default", "a site spec")
        default, default_reasons = _parse_site(default_data, "default", ())
    rules_data = data.get("rules", [])
    if rules_data is None:
        rules_data = []
    if not isinstance(rules_data, list):
        raise PlanError(f"rules must be a list of rules, got {_type_name(rules_data)}")
    rules = []
    for index, item in enumerate(rules_data):
        where = _at("rules", index)
        rule_data = _expect_mapping(item, where, "a rule with 'match'")
        if "match" not in rule_data:
            raise PlanError(f"{where}: missing key 'match' (a glob over site names)")
        pattern = rule_data["match"]
        if not isinstance(pattern, str):
            raise PlanError(f"{where}.match must be a string, got {_type_name(pattern)}")
        if not pattern:
            raise PlanError(f"{where}.match must not be empty")
        optional = rule_data.get("optional", False)
        if not isinstance(optional, bool):
            raise PlanError(f"{where}.optional must be a bool, got {_type_name(optional)}")
        spec, reasons = _parse_site(rule_data, where, ("match", "optional"))
        rules.append(Rule(pattern, spec, reasons, optional))
    return default, tuple(rules), default_reasons
