"""Finding policies by name (decorator, entry point, `module:Class`), building them from config,
and the package's purity (no Ray, no torch, no clock, no printing, no files)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

import config
import policies
from policies import (
    ENTRY_POINT_GROUP,
    DefaultDynamicSchedulePolicy,
    DynamicScheduleContext,
    DynamicSchedulePolicyBase,
    FixedRatioDynamicSchedulePolicy,
    GuardedPolicy,
    PredictiveDynamicSchedulePolicy,
    StaticFullyAsyncPolicy,
    UnknownPolicyError,
    build_policy,
    context_from_config,
    policy_from_config,
    register_policy,
    registered_policies,
)

CTX = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4)  # 64 per cycle
POLICIES_DIR = Path(policies.__file__).parent
REPO_ROOT = POLICIES_DIR.parent
BUILT_INS = {
    "default": DefaultDynamicSchedulePolicy,
    "fixed_ratio": FixedRatioDynamicSchedulePolicy,
    "static_fully_async": StaticFullyAsyncPolicy,
    "predictive": PredictiveDynamicSchedulePolicy,
}

# --------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("name", sorted(BUILT_INS))
def test_every_built_in_is_registered_on_import_and_builds_with_the_reference_arguments(name: str) -> None:
    assert name in registered_policies()
    policy = build_policy(name, deactivate_ratio=0.3, only_hybrid=False)
    assert type(policy) is BUILT_INS[name]


def test_an_unknown_name_fails_with_the_list_of_known_names() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        build_policy("no_such_policy")
    message = str(info.value)
    assert "no_such_policy" in message
    for name in BUILT_INS:
        assert name in message
    assert ", ".join(registered_policies()) in message
    assert isinstance(info.value, KeyError)


# --------------------------------------------------------------------------- (a) decorator


def test_a_reference_style_policy_registers_with_the_decorator_and_builds_by_name() -> None:
    from custom_policy_pkg.reference_style import MyDynamicSchedulePolicy

    assert "my_policy" in registered_policies()
    policy = build_policy("my_policy", deactivate_ratio=0.25, only_hybrid=False)
    assert type(policy) is MyDynamicSchedulePolicy
    assert policy.should_deactivate(1, True, CTX) is True
    assert policy.deactivate_wait_samples(CTX) == 16  # 16 × 4 × 0.25
    # generated 10 < consumed 64 + buffer 32 → activate
    ctx = replace(CTX, total_generated_samples=10, expected_samples=64, buffer_samples=32)
    assert policy.should_activate_after_step(1, False, ctx) is True
    assert policy.request_rebalance(1, ctx) is None
    policy.update_after_step(1, ctx)
    assert policy.state_dict() == {"deactivate_ratio": 0.25, "only_hybrid": False}


def test_re_registering_the_same_class_is_harmless_but_a_second_class_cannot_take_a_name() -> None:
    from custom_policy_pkg.reference_style import MyDynamicSchedulePolicy

    assert register_policy("my_policy")(MyDynamicSchedulePolicy) is MyDynamicSchedulePolicy

    class Impostor(StaticFullyAsyncPolicy):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_policy("default")(Impostor)
    assert type(build_policy("default")) is DefaultDynamicSchedulePolicy


@pytest.mark.parametrize("not_a_policy", ["class", "instance"])
def test_registering_something_that_is_not_a_policy_class_is_a_type_error(not_a_policy: str) -> None:
    from custom_policy_pkg.reference_style import MyDynamicSchedulePolicy, NotAPolicy

    target = NotAPolicy if not_a_policy == "class" else MyDynamicSchedulePolicy()
    with pytest.raises(TypeError, match="not a DynamicSchedulePolicyBase subclass"):
        register_policy("not_a_policy")(target)
    assert "not_a_policy" not in registered_policies()


# --------------------------------------------------------------------------- (b) entry point

ENTRY_POLICY_SOURCE = '''
from policies import DynamicScheduleContext, DynamicSchedulePolicyBase


class EntryPolicy(DynamicSchedulePolicyBase):
    def __init__(self, deactivate_ratio: float = 0.5, only_hybrid: bool = False):
        self.deactivate_ratio = deactivate_ratio
        self.only_hybrid = only_hybrid

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(ctx.required_samples * ctx.trigger_parameter_sync_step * self.deactivate_ratio)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return ctx.total_generated_samples < ctx.expected_samples + ctx.buffer_samples

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        pass
'''


@pytest.fixture
def installed_entry_point_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real (unpacked) distribution on sys.path that declares `entry_policy` in `tidal.policies`."""
    package = tmp_path / "mypkg_policies"
    package.mkdir()
    (package / "__init__.py").write_text(ENTRY_POLICY_SOURCE)
    dist_info = tmp_path / "tidal_test_policies-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: tidal_test_policies\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nentry_policy = mypkg_policies:EntryPolicy\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    sys.modules.pop("mypkg_policies", None)


def test_an_entry_point_of_group_tidal_policies_is_listed_and_builds(
    installed_entry_point_distribution: Path,
) -> None:
    assert ENTRY_POINT_GROUP == "tidal.policies"
    assert "entry_policy" in registered_policies()
    policy = build_policy("entry_policy", deactivate_ratio=0.75)
    assert type(policy).__name__ == "EntryPolicy"
    assert type(policy).__module__ == "mypkg_policies"
    assert policy.deactivate_wait_samples(CTX) == 48  # 64 × 0.75
    assert policy.should_deactivate(2, True, CTX) is True


# --------------------------------------------------------------------------- (c) module:Class


def test_a_module_colon_class_string_imports_and_builds_an_unregistered_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "custom_policy_pkg.by_path", raising=False)
    policy = build_policy("custom_policy_pkg.by_path:EveryCyclePolicy", deactivate_ratio=0.5)
    assert type(policy).__name__ == "EveryCyclePolicy"
    assert policy.deactivate_wait_samples(CTX) == 32  # 64 × 0.5
    assert policy.should_activate_after_step(1, False, CTX) is True
    assert "custom_policy_pkg.by_path:EveryCyclePolicy" not in registered_policies()


def test_a_reference_style_policy_also_builds_from_its_module_colon_class_string() -> None:
    policy = build_policy("custom_policy_pkg.reference_style:MyDynamicSchedulePolicy", deactivate_ratio=0.5)
    assert policy.deactivate_wait_samples(CTX) == 32


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("custom_policy_pkg.reference_style:NotAPolicy", "not a DynamicSchedulePolicyBase subclass"),
        ("custom_policy_pkg.reference_style:Missing", "not a DynamicSchedulePolicyBase subclass"),
        ("custom_policy_pkg.no_such_module:Anything", "cannot import module"),
    ],
)
def test_a_module_colon_class_string_that_does_not_name_a_policy_fails(name: str, reason: str) -> None:
    with pytest.raises(UnknownPolicyError, match=reason):
        build_policy(name)


def test_a_module_colon_string_naming_a_function_is_not_a_policy() -> None:
    with pytest.raises(UnknownPolicyError, match="not a DynamicSchedulePolicyBase subclass"):
        build_policy("policies:build_policy")


# --------------------------------------------------------------------------- from config


def test_a_config_with_a_min_dwell_gives_a_guarded_policy_with_the_configured_ratio() -> None:
    cfg = config.load_config("tiny-cpu", ["async_training.dynamic_schedule_min_dwell_s=5"])
    policy = policy_from_config(cfg)
    assert isinstance(policy, GuardedPolicy)
    assert isinstance(policy.inner, DefaultDynamicSchedulePolicy)
    assert policy.min_dwell_s == 5.0
    assert policy.deactivate_ratio == 0.6  # tiny-cpu's dynamic_schedule_deactivate_ratio


def test_a_config_without_a_dwell_gives_the_bare_policy() -> None:
    policy = policy_from_config(config.load_config("tiny-cpu"))
    assert type(policy) is DefaultDynamicSchedulePolicy
    assert policy.deactivate_ratio == 0.6


def test_a_config_with_no_standalone_pool_builds_an_only_hybrid_policy() -> None:
    policy = policy_from_config(config.load_config("tiny-cpu", ["rollout.nnodes=0"]))
    assert policy.only_hybrid is True
    assert policy.deactivate_ratio == 1.0


def test_the_config_names_the_policy() -> None:
    cfg = config.load_config("tiny-cpu", ["async_training.dynamic_schedule_policy=static_fully_async"])
    assert type(policy_from_config(cfg)) is StaticFullyAsyncPolicy


def test_context_from_config_fills_the_static_fields_and_takes_runtime_ones() -> None:
    cfg = config.load_config("tiny-cpu", ["async_training.dynamic_schedule_min_dwell_s=5"])
    ctx = context_from_config(cfg, now=12.5, total_generated_samples=20, expected_samples=16)
    # tiny-cpu: ppo_mini_batch_size 8 × require_batches 1 = 8; trigger 2 → 16 per cycle;
    # buffer = int(16 × staleness 0.5) = 8; one standalone GPU and one trainer GPU (tp 1)
    assert ctx == DynamicScheduleContext(
        required_samples=8,
        trigger_parameter_sync_step=2,
        buffer_samples=8,
        only_hybrid=False,
        standalone_replicas=1,
        hybrid_replicas=1,
        now=12.5,
        total_generated_samples=20,
        expected_samples=16,
    )
    assert ctx.step_required_samples == 16
    assert ctx.surplus == 4
    # the configured policy answers on it: 16 × 0.6 = 9.6 → 9
    assert policy_from_config(cfg).deactivate_wait_samples(ctx) == 9


# --------------------------------------------------------------------------- purity


def test_importing_policies_pulls_in_neither_ray_nor_torch() -> None:
    probe = textwrap.dedent(
        """
        import sys
        import policies
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"ray", "torch"})
        print(repr(heavy))
        print("policies" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["[]", "True"]


POLICY_SOURCES = sorted(POLICIES_DIR.glob("*.py"))


def test_the_purity_scan_covers_every_policy_module() -> None:
    assert {"__init__.py", "base.py", "builtin.py", "guard.py", "registry.py"} <= {p.name for p in POLICY_SOURCES}


@pytest.mark.parametrize("source", POLICY_SOURCES, ids=lambda p: p.name)
def test_no_policy_module_reads_the_clock_prints_or_opens_files(source: Path) -> None:
    text = source.read_text()
    for needle in ("time.", "print(", "open("):
        assert needle not in text, f"{source.name} contains {needle!r}"
    tree = ast.parse(text)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported.isdisjoint({"time", "datetime", "logging", "ray", "torch"}), imported
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert called.isdisjoint({"print", "open", "input"}), called


def test_the_base_class_cannot_be_instantiated_without_the_three_hooks() -> None:
    with pytest.raises(TypeError):
        DynamicSchedulePolicyBase()  # type: ignore[abstract]
