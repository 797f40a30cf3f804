"""Precision plans as data: which format, scaling and rounding every operand of every GEMM site uses.

A *site* is one GEMM-bearing call in a model (an ``nn.Linear``, a transformers ``Conv1D``, a matmul in
forward code). Each site has three GEMMs, each with two operands:

========  =========================  ============================
gemm      product                    operands
========  =========================  ============================
fprop     y  = x · Wᵀ                ``input``, ``weight``
dgrad     dx = dy · W                ``grad_output``, ``weight``
wgrad     dW = dyᵀ · x               ``grad_output``, ``input``
========  =========================  ============================

For a matmul site ``y = a @ b`` the same names are used with ``input`` = a and ``weight`` = b, so dgrad
is ``da = dy · bᵀ`` and wgrad is ``db = aᵀ · dy``.

A :class:`Plan` holds a default :class:`SiteSpec` and an ordered list of :class:`Rule` s, each a glob
pattern over site names with its own complete :class:`SiteSpec`. :meth:`Plan.for_site` returns the spec of
the **last** rule whose pattern matches, else the default. A rule replaces the default for the sites it
matches; it does not merge with it: an operand a rule does not name stays ``high`` (unquantized).

Plan files are YAML (version key ``numscope_plan: 1``)::

    numscope_plan: 1
    default:                                  # TE "hybrid": E4M3 for x and W, E5M2 for dy
      input: fp8_e4m3
      weight: fp8_e4m3
      grad_output: fp8_e5m2
      accumulate: fp32
    rules:
      - match: "*.attention.self.scores"      # fnmatch glob over site names
        all: high                             # every operand of every GEMM
      - match: "bert.encoder.layer.*.output.dense"
        fprop: {input: {format: mxfp8_e4m3, rounding: nearest}, weight: mxfp8_e4m3}
        wgrad: {grad_output: {format: fp8_e5m2, scaling: {kind: delayed, history_len: 16}}}
        reasons: {fprop/input: "backward error 1.2e-3 <= 2x bf16"}

Keys of a site spec (``default`` or a rule), applied broadest first, later ones overriding earlier ones
operand by operand: ``all`` (the six operands) → ``forward`` (fprop) / ``backward`` (dgrad and wgrad) →
``input`` / ``weight`` / ``grad_output`` (that operand in every GEMM that takes it) → ``fprop`` /
``dgrad`` / ``wgrad`` (a mapping operand → spec, or one spec for both operands). Besides: ``accumulate``
(``fp32``, ``bf16``, ``fp16``, ``fp22``, ``fp22_promote128``; default ``fp32``; or per GEMM, e.g.
``{fprop: fp22}``, the others ``fp32``), ``reasons``
(``"gemm/operand"`` → text) and, in a rule, ``match`` and ``optional`` (``true``: the rule may match no
site; :meth:`Plan.check_sites` reports only the others). An operand spec is a format name, ``high``, or a
mapping with ``format`` and optionally ``scaling`` (a kind name or a mapping of :class:`numscope.Scaling`
fields), ``rounding``, ``overflow``, ``flush_subnormals``, ``transform`` (``rht16``: a random Hadamard
transform of blocks of 16 along the GEMM's contraction axis before the cast, undone after it;
``rht32:7`` blocks of 32 with sign seed 7).
"""

from __future__ import annotations

from numscope._lazy import lazy_exports
from numscope.formats.scaling import default_scaling
from numscope.plan import recipes as _recipes  # noqa: F401  (registers the field's named recipes with Plan)
from numscope.plan.plan import Plan
from numscope.plan.spec import (
    ACCUMULATE,
    DEFAULT_PATTERN,
    HIGH,
    HIGH_SPEC,
    OperandSpec,
    PlanError,
    PlanRow,
    Rule,
    SiteSpec,
)
from numscope.vocab import GEMMS, OPERAND_KEYS, OPERANDS

__all__ = [
    "ACCUMULATE",
    "DEFAULT_PATTERN",
    "GEMMS",
    "HIGH",
    "HIGH_SPEC",
    "OPERANDS",
    "OPERAND_KEYS",
    "OperandSpec",
    "Plan",
    "PlanError",
    "PlanRow",
    "Rule",
    "SiteSpec",
    "default_scaling",
]


# the field's recipes and the exports, loaded on first use
__getattr__, __dir__ = lazy_exports(
    __name__, {}, {"recipes": "numscope.plan.recipes", "export": "numscope.plan.export"}
)
