"""The ``polyhal explain`` command and the policy arguments of the CLI (``--policy``,
``--device-lead-allocator``, ``--oom-fallback``). The decision records themselves are made by
:mod:`polyhal.policy` (``polyhal.policy.explain()``).

Every decision the selector computed is listed with its candidates, the memory type and usage
asked for, the chosen device, the plugin that chose it and the reason that plugin recorded
(``polyhal.policy.record_reason``), the candidates excluded because they cannot serve the memory
type, and the order the out-of-memory fallback would try.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from polyhal.ir.program import Program, ProgramBuilder
from polyhal.plan import compile as compile_program
from polyhal.policies.context import BUILTIN_POLICIES, configure_policy
from polyhal.policies.cost import measure_link
# The decision records live with the selector (polyhal.policy); re-exported here for the CLI.
from polyhal.policy import decision_record, explain_records, format_decisions, selector_for

if TYPE_CHECKING:
    from polyhal.registry import Registry

__all__ = ["add_explain_parser", "add_policy_arguments", "apply_policy_arguments", "cmd_explain", "printable",
           "decision_record", "demo_program", "explain_records", "format_decisions"]


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def printable(text: str) -> str:
    """``text`` safe to print on a terminal: every control or format character but newline
    (escape sequences, carriage returns, bidirectional overrides) shown as its Python escape
    (``\\x1b``), so that a name a model or a file provides cannot rewrite the screen. The CLI
    prints every model-provided name through it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--policy``, ``--device-lead-allocator``, ``--oom-fallback`` (override the environment)."""
    parser.add_argument("--policy", choices=sorted(BUILTIN_POLICIES), default=None,
                        help="built-in device policy (default: POLYHAL_POLICY, else first)")
    parser.add_argument("--device-lead-allocator", type=int, default=None, metavar="N",
                        help="lead policy: the Nth --device allocates shared buffers (POLYHAL_DEVICE_LEAD_ALLOCATOR)")
    parser.add_argument("--oom-fallback", action="store_true", default=None,
                        help="when the chosen device is out of memory, try the other candidates (POLYHAL_OOM_FALLBACK)")


def apply_policy_arguments(args: argparse.Namespace, registry: "Registry") -> None:
    """Configure the registry's policy from the arguments that were given."""
    kwargs: dict[str, Any] = {}
    if getattr(args, "policy", None):
        kwargs["policy"] = args.policy
    if getattr(args, "device_lead_allocator", None) is not None:
        kwargs["lead_allocator"] = args.device_lead_allocator
    if getattr(args, "oom_fallback", None):
        kwargs["oom_fallback"] = True
    if kwargs:
        configure_policy(registry, **kwargs)


def demo_program(batch: int = 64) -> Program:
    """The MLP block of ``polyhal demo`` (matmul, gelu, matmul, add, layer_norm, softmax)."""
    n, d, h = batch, 256, 512
    b = ProgramBuilder("mlp_block")
    x = b.input("x", (n, d))
    w1, w2 = b.input("w1", (d, h)), b.input("w2", (h, d))
    gamma, beta = b.input("gamma", (d,)), b.input("beta", (d,))
    y = b.matmul(b.gelu(b.matmul(x, w1)), w2)
    b.output(b.softmax(b.layer_norm(b.add(y, x), gamma, beta), axis=-1))
    return b.build()


def cmd_explain(args: argparse.Namespace, registry: "Registry") -> int:
    """Compile the demo program over ``--device`` (default: every device) with the chosen policy and
    print its placement and every allocation decision, with the plugin that made it and why."""
    apply_policy_arguments(args, registry)
    devices = args.device or registry.default_devices()
    if args.measure_links:
        for src in devices:
            for dst in devices:
                if src != dst:
                    measure_link(registry, src, dst)
    plan = compile_program(demo_program(args.batch), devices, registry=registry)
    selector = selector_for(registry)
    if args.json:
        json.dump({"devices": list(devices), "placement": plan.explain().splitlines(),
                   **explain_records(selector)}, sys.stdout, indent=2)
        print()
        return 0
    print(f"--device list: {', '.join(devices)}")
    print(plan.explain())
    print(selector.explain())
    return 0


def add_explain_parser(sub: Any) -> None:
    """The ``polyhal explain`` subcommand."""
    p = sub.add_parser("explain", help="compile the demo program and explain every allocation decision")
    p.add_argument("--device", action="append", default=None,
                   help="a device of the --device list, in order (repeat it; default: every device)")
    add_policy_arguments(p)
    p.add_argument("--measure-links", action="store_true", help="measure link bandwidths for the cost policy first")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", action="store_true", help="machine-readable output")
