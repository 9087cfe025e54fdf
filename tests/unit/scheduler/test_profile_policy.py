"""The profile policy's pure check: what env, engine_args and image a profile may set."""

from __future__ import annotations

import pytest
from profile_builders import make_llamacpp, make_vllm

from caravan_llm.scheduler.profile_policy import ProfilePolicy, flag_name, policy_problems
from caravan_llm.scheduler.profiles import Engine

DEFAULT = ProfilePolicy()


def names(problems: list[str]) -> list[str]:
    """The field: value head of each problem line."""
    return [p.split(" is ", 1)[0] for p in problems]


@pytest.mark.parametrize(
    "variable",
    [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "DYLD_INSERT_LIBRARIES",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "PYTHONUSERBASE",
        "BASH_ENV",
        "ENV",
        "NODE_OPTIONS",
        "PERL5LIB",
        "GLIBC_TUNABLES",
        "OPENSSL_CONF",
        "PATH",
        "NVIDIA_VISIBLE_DEVICES",
        "NOMAD_TOKEN",
        "LLAMA_ARG_HOST",
        "VLLM_PLUGINS",
    ],
)
def test_code_loading_variables_are_refused_by_name(variable):
    """Each variable that changes what code loads is refused with a line naming it."""
    problems = policy_problems(make_vllm(env={variable: "x"}), DEFAULT)
    assert [f"env: {variable}"] == names(problems)
    assert "profile_policy.allow_env" in problems[0]


def test_a_secret_cannot_set_a_refused_variable():
    """Secrets become environment variables too, so the same names are refused there."""
    problems = policy_problems(make_vllm(secrets={"LD_PRELOAD": "caravan/secrets/x"}), DEFAULT)
    assert ["secrets: LD_PRELOAD"] == names(problems)


def test_ordinary_variables_pass():
    """HF_HOME, PYTHONUNBUFFERED and caravan's own simulation knobs are fine."""
    env = {"HF_HOME": "/alloc/data/hf", "PYTHONUNBUFFERED": "1", "CARAVAN_SIM_STEP_SECONDS": "1"}
    assert [] == policy_problems(make_vllm(env=env), DEFAULT)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trust-remote-code"], "engine_args: --trust-remote-code"),
        (["--trust_remote_code"], "engine_args: --trust-remote-code"),
        (["--trust-remote-code=true"], "engine_args: --trust-remote-code"),
        (["--trust-remote"], "engine_args: --trust-remote (read by vllm as --trust-remote-code)"),
        (["--worker-cls", "x.Y"], "engine_args: --worker-cls"),
        (["--worker-extension-cls", "x.Y"], "engine_args: --worker-extension-cls"),
        (["--allowed-local-media-path", "/"], "engine_args: --allowed-local-media-path"),
        (["--middleware", "evil.App"], "engine_args: --middleware"),
        (
            ["--kv-transfer-config.kv_connector_module_path=evil"],
            "engine_args: --kv-transfer-config",
        ),
        (["--config", "more.yaml"], "engine_args: --config"),
    ],
)
def test_vllm_flags_that_load_code_are_refused_by_name(args, expected):
    """vLLM flags are matched as vLLM parses them: underscores, =values, fields, prefixes."""
    assert [expected] == names(policy_problems(make_vllm(engine_args=args), DEFAULT))


@pytest.mark.parametrize(
    "flag", ["--path", "--slot-save-path", "--log-file", "--rpc", "--api-key", "--tools"]
)
def test_llamacpp_flags_that_reach_the_node_are_refused(flag):
    """llama-server flags that serve files, write files or reach other hosts are refused."""
    problems = policy_problems(make_llamacpp(engine_args=[flag, "value"]), DEFAULT)
    assert [f"engine_args: {flag}"] == names(problems)


def test_ordinary_flags_and_values_pass():
    """Tuning flags, negative numbers and flag values are not mistaken for denied flags."""
    vllm = make_vllm(engine_args=["--gpu-memory-utilization", "0.9", "--seed", "-1"])
    llama = make_llamacpp(engine_args=["-ngl", "-1", "--config-check", "x"])
    assert [] == policy_problems(vllm, DEFAULT) + policy_problems(llama, DEFAULT)


def test_operator_allow_list_admits_named_exceptions():
    """An operator may allow a variable, a prefix and a flag; the rest stays refused."""
    policy = ProfilePolicy(
        allow_env=("LD_LIBRARY_PATH", "LLAMA_ARG_*"),
        allow_engine_args=("--trust-remote-code",),
    )
    profile = make_vllm(
        env={"LD_LIBRARY_PATH": "/opt/lib", "LLAMA_ARG_X": "1", "LD_PRELOAD": "/x.so"},
        engine_args=["--trust-remote-code", "--worker-cls", "a.B"],
    )
    assert ["env: LD_PRELOAD", "engine_args: --worker-cls"] == names(
        policy_problems(profile, policy)
    )


def test_operator_deny_list_refuses_more():
    """deny_env and deny_engine_args add to the defaults."""
    policy = ProfilePolicy(deny_env=("HF_*",), deny_engine_args=("--enable-lora",))
    profile = make_vllm(env={"HF_TOKEN": "t"}, engine_args=["--enable-lora"])
    assert ["env: HF_TOKEN", "engine_args: --enable-lora"] == names(
        policy_problems(profile, policy)
    )


def test_image_must_be_the_clusters_unless_allowed():
    """An image override is refused unless it is a cluster image or allowed by the operator."""
    profile = make_vllm(image="attacker/vllm:latest")
    cluster = {"vllm/vllm-openai:v0.11.0"}
    refused = policy_problems(profile, DEFAULT, cluster_images=cluster)
    allowed = policy_problems(
        profile, ProfilePolicy(allowed_images=("attacker/vllm:latest",)), cluster_images=cluster
    )
    same = policy_problems(
        make_vllm(image="vllm/vllm-openai:v0.11.0"), DEFAULT, cluster_images=cluster
    )
    assert ["image: attacker/vllm:latest"] == names(refused)
    assert [] == allowed
    assert [] == same


@pytest.mark.parametrize(
    ("engine", "arg", "expected"),
    [
        (Engine.VLLM, "--a_b=1", "--a-b"),
        (Engine.VLLM, "--x.y.z", "--x"),
        (Engine.LLAMACPP, "--a_b", "--a_b"),
        (Engine.VLLM, "value", None),
        (Engine.VLLM, "-3.5", None),
    ],
)
def test_flag_name_normalises_as_the_engine_parses(engine, arg, expected):
    """vLLM folds underscores and dotted fields; llama.cpp takes flags as written."""
    assert expected == flag_name(engine, arg)
