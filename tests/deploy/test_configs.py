"""deploy/: the `ray up` cluster YAMLs pass Ray's own cluster-config preparation and JSON-schema
validation, and the Serve config files pass Serve's schema, name only known settings, split one
8-GPU node between prefill and decode, and build into the application they describe."""
from __future__ import annotations

import os
from typing import Any

import pytest
import yaml

from cluster.config import ClusterConfig, parse_cluster_args

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deploy")
CLUSTER_FILES = ["cluster-aws.yaml", "cluster-local.yaml"]
SERVE_FILES = ["serve.yaml", "serve-autoscale.yaml", "serve-cpu.yaml"]
GPUS_PER_NODE = 8


def load(name: str) -> dict[str, Any]:
    with open(os.path.join(DEPLOY, name)) as f:
        return yaml.safe_load(f)


def app_config(name: str) -> tuple[Any, ClusterConfig]:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(load(name))
    assert len(schema.applications) == 1
    app = schema.applications[0]
    return app, parse_cluster_args(app.args, use_env=False)


# --- `ray up` cluster configs ----------------------------------------------------------------------

@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_config_passes_ray_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(load(name))  # what `ray up` does before talking to the provider
    validate_config(prepared)  # ray/autoscaler/ray-schema.json plus Ray's own checks
    assert prepared["docker"]["image"].startswith("rayproject/ray:2.60.0-py311")
    setup = " ".join(prepared["setup_commands"])
    assert "torch==" in setup and "pd-cluster[serve" in setup
    assert "~/pd-cluster" in prepared["file_mounts"]


def test_aws_cluster_has_a_cpu_head_and_8_gpu_workers():
    from ray.autoscaler._private.util import prepare_config

    config = prepare_config(load("cluster-aws.yaml"))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["max_workers"] == 0
    assert workers and all(t["resources"]["GPU"] == GPUS_PER_NODE for t in workers)
    assert all(0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"] for t in workers)


def test_local_cluster_lists_its_hosts():
    from ray.autoscaler._private.util import prepare_config

    raw = load("cluster-local.yaml")
    config = prepare_config(raw)
    assert raw["provider"]["head_ip"] and raw["provider"]["worker_ips"]
    assert config["max_workers"] == len(raw["provider"]["worker_ips"])
    assert raw["auth"]["ssh_user"] and raw["auth"]["ssh_private_key"]


# --- Serve configs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SERVE_FILES)
def test_serve_config_passes_serve_schema_and_names_known_settings(name):
    app, config = app_config(name)
    assert app.import_path == "cluster.app" and app.route_prefix == "/"
    assert config.model.tensor_parallel_size == 1


def test_serve_yaml_splits_one_8_gpu_node():
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(load("serve.yaml"))
    assert schema.http_options.host == "127.0.0.1" and schema.http_options.port == 8000  # see deploy/README.md
    _, config = app_config("serve.yaml")
    assert config.num_gpus == 1 and config.prefill_replicas > 0 and config.decode_replicas > 0
    assert (config.prefill_replicas + config.decode_replicas) * config.num_gpus == GPUS_PER_NODE
    assert config.transfer.backend == "ipc" and config.model.model.startswith("/models/")


def test_autoscale_yaml_gives_the_planner_one_8_gpu_node():
    from ray._common.utils import import_attr

    from cluster.router.planner import plan_application

    app, config = app_config("serve-autoscale.yaml")
    assert config.autoscale and config.num_gpus == 1
    assert config.max_total_replicas is not None
    assert config.max_total_replicas * config.num_gpus == GPUS_PER_NODE
    assert (config.prefill_replicas + config.decode_replicas) * config.num_gpus <= GPUS_PER_NODE
    assert import_attr(app.autoscaling_policy["policy_function"]) is plan_application


def test_cpu_yaml_runs_without_gpus():
    _, config = app_config("serve-cpu.yaml")
    assert config.num_gpus == 0 and config.model.model == "smollm2" and config.host == "127.0.0.1"


@pytest.mark.parametrize("name", ["serve-cpu.yaml", "serve-autoscale.yaml"])
def test_serve_config_builds_its_application(name):
    """The application the file describes, built as Serve builds it (no Ray started); the GPU
    configs' model is swapped for the embedded one, whose tokenizer is here."""
    from ray.serve._private.build_app import build_app

    import cluster

    app, config = app_config(name)
    args = dict(app.args, model="smollm2")
    built = {d.name: d for d in build_app(cluster.app(args), name=app.name).deployments}
    assert set(built) == {"Ingress", "ClusterState", "PrefillServer", "DecodeServer"}
    for role, replicas in (("PrefillServer", config.prefill_replicas), ("DecodeServer", config.decode_replicas)):
        deployment = built[role]
        assert deployment.ray_actor_options["num_gpus"] == config.num_gpus
        scaling = deployment._deployment_config.autoscaling_config
        if config.autoscale:
            assert (scaling.min_replicas, scaling.max_replicas) == (config.min_replicas, config.max_replicas)
            assert scaling.initial_replicas == replicas
            assert scaling.policy.policy_function == "cluster.router.planner:plan_deployment"
            assert scaling.policy.policy_kwargs["max_total_replicas"] == config.max_total_replicas
        else:
            assert scaling is None and deployment.num_replicas == replicas


def test_serve_build_writes_a_config_of_the_default_app(tmp_path):
    """``serve build cluster:default_app`` writes a Serve config file with the four deployments
    (``serve build cluster:app`` cannot: Serve builds files only from a built Application, and
    ``app`` is the builder that ``serve run cluster.app key=value`` needs)."""
    import shutil
    import subprocess
    import sys
    serve_cli = shutil.which("serve") or os.path.join(os.path.dirname(sys.executable), "serve")
    out = tmp_path / "built.yaml"
    subprocess.run([serve_cli, "build", "cluster:default_app", "-o", str(out)], check=True, timeout=120,
                   capture_output=True)
    [app] = yaml.safe_load(out.read_text())["applications"]
    assert app["import_path"] == "cluster:default_app"
    assert {d["name"] for d in app["deployments"]} == {"Ingress", "DecodeServer", "PrefillServer", "ClusterState"}
