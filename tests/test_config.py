"""Configuration: defaults < TOML file < environment, with clear errors."""
import pytest

from fleetscope.config import ConfigError, load
from fleetscope.producers.agent import identity_rules


def test_environment_overrides_the_file_which_overrides_defaults(tmp_path):
    f = tmp_path / "fs.toml"
    f.write_text('partitions = 8\nwindow_s = 2.5\ndefault_tenant = "ml-platform"\njob_env = ["MY_JOB"]\n')
    cfg = load(f, env={"FLEETSCOPE_PARTITIONS": "16", "FLEETSCOPE_NVML": "off"})
    assert (cfg.partitions, cfg.window_s, cfg.nvml) == (16, 2.5, False)
    rules = identity_rules(cfg)
    assert (rules.default_tenant, rules.job_env, rules.tenant_env) == ("ml-platform", ("MY_JOB",), "FLEETSCOPE_TENANT")


def test_configured_identity_rules_decide_tenant_and_job():
    rules = identity_rules(load(env={"FLEETSCOPE_TENANT_ENV": "TEAM", "FLEETSCOPE_TENANT_ENV_TRUSTED": "true",
                                     "FLEETSCOPE_JOB_ENV": "RUN_NAME,SLURM_JOB_ID"}))
    env = {"TEAM": "vision", "RUN_NAME": "resnet-7", "SLURM_JOB_ID": "99"}
    assert rules.tenant(env, pod="") == "vision"
    assert rules.job(env, host="n1")[0] == "resnet-7"


@pytest.mark.parametrize("env, message", [
    ({"FLEETSCOPE_SAMPLE_INTERVAL_S": "0.01"}, "must lie in"),
    ({"FLEETSCOPE_PARTITIONS": "many"}, "partitions"),
    ({"FLEETSCOPE_NVML": "maybe"}, "true/false"),
    ({"FLEETSCOPE_TRACE_CAPTURE_ANOMALIES": "sometimes"}, "trace_capture_anomalies='sometimes': expected true/false"),
])
def test_bad_values_are_clear_errors(env, message):
    with pytest.raises(ConfigError, match=message):
        load(env=env)


def test_missing_config_file_says_which(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.toml", env={})


def test_anomaly_capture_is_on_by_default_and_the_file_or_environment_turns_it_off(tmp_path):
    assert load(env={}).trace_capture_anomalies is True
    assert load(env={"FLEETSCOPE_TRACE_CAPTURE_ANOMALIES": "off"}).trace_capture_anomalies is False
    f = tmp_path / "fs.toml"
    f.write_text("trace_capture_s = 30\ntrace_capture_anomalies = false\n")
    cfg = load(f, env={})
    assert (cfg.trace_capture_s, cfg.trace_capture_anomalies) == (30.0, False)
    assert load(f, env={"FLEETSCOPE_TRACE_CAPTURE_ANOMALIES": "true"}).trace_capture_anomalies is True
