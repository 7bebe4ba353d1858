"""``[inference.sglang]``: the typed section, the command lines it launches, and the trainer's
weights written as a directory SGLang loads from disk."""

from __future__ import annotations


import msgspec
import pytest
import pytest_asyncio
import torch
from safetensors import safe_open

from rollmesh.config import ConfigError, InferenceConfig, SGLangConfig, load_config
from rollmesh.engine.models import load_hf_model
from rollmesh.engine.sglang_backend import SGLangEngine
from rollmesh.engine.sglang_launch import launch_plan, other_node_commands, server_flags
from rollmesh.engine.sglang_weights import SGLangDiskWeights, write_hf_weights
from support.sglang_fake import FakeSGLang

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def ports() -> object:
    counter = iter(range(40000, 40100))
    return lambda host: next(counter)


def test_each_typed_key_becomes_its_sglang_flag():
    config = SGLangConfig(tp_size=8, dp_size=8, ep_size=8, enable_dp_attention=True, moe_a2a_backend="deepep",
                          speculative_algorithm="EAGLE3", speculative_draft_model_path="/draft",
                          speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                          nnodes=2, dist_init_addr="10.0.0.1:5000", skip_tokenizer_init=True)
    assert server_flags(config) == [
        "--tp-size", "8", "--dp-size", "8", "--ep-size", "8", "--enable-dp-attention",
        "--moe-a2a-backend", "deepep", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/draft", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.1:5000", "--skip-tokenizer-init",
    ]
    assert server_flags(SGLangConfig()) == ["--tp-size", "1"]


def test_a_worker_launches_one_server_by_default_on_the_model_with_routed_experts_for_moe():
    config = SGLangConfig(python="/sg/bin/python", extra_args=["--mem-fraction-static", "0.5"])
    plan = launch_plan(config, index=0, model_path="/models/m", routed_experts=True, pick_port=ports())
    [server] = plan.servers
    assert server.argv() == [
        "/sg/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/m", "--host", "127.0.0.1",
        "--port", "40000", "--weight-version", "0", "--enable-return-routed-experts", "--tp-size", "1",
        "--mem-fraction-static", "0.5"]
    assert (plan.router, plan.generate_url, plan.admin_urls) == (None, server.url, [server.url])
    fixed = launch_plan(SGLangConfig(port=30000), index=2, model_path="/m", routed_experts=False, pick_port=ports())
    assert fixed.servers[0].port == 30006


def test_pd_disaggregation_launches_a_prefill_and_a_decode_server_and_their_router():
    config = SGLangConfig(disaggregation="pd", disaggregation_transfer_backend="nixl", tp_size=2,
                          router_python="/router/bin/python")
    plan = launch_plan(config, index=1, model_path="/m", routed_experts=False, pick_port=ports())
    prefill, decode = plan.servers
    assert prefill.flags == ["--tp-size", "2", "--disaggregation-mode", "prefill",
                             "--disaggregation-transfer-backend", "nixl", "--disaggregation-bootstrap-port", "8999"]
    assert decode.flags == ["--tp-size", "2", "--disaggregation-mode", "decode",
                            "--disaggregation-transfer-backend", "nixl", "--base-gpu-id", "2"]
    assert plan.router.argv() == [
        "/router/bin/python", "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", prefill.url, "8999", "--decode", decode.url, "--host", "127.0.0.1", "--port", "40002"]
    # Requests go through the router; weights and pauses to both servers.
    assert (plan.generate_url, plan.admin_urls) == (plan.router.url, [prefill.url, decode.url])


def test_attaching_to_urls_launches_nothing_and_gives_one_worker_per_url():
    config = SGLangConfig(urls=["http://a:30000/", "http://b:30000"])
    plan = launch_plan(config, index=1, model_path="/m", routed_experts=False, pick_port=ports())
    assert (plan.servers, plan.router, plan.generate_url) == ([], None, "http://b:30000")
    inference = InferenceConfig(backend="sglang", sglang=config, num_decode_workers=5)
    assert (inference.decode_worker_count, inference.prefill_worker_count) == (2, 0)
    assert InferenceConfig().prefill_worker_count == 1 and InferenceConfig().decode_worker_count == 1


def test_multi_node_servers_say_how_to_start_their_other_node_ranks():
    config = SGLangConfig(nnodes=3, dist_init_addr="10.0.0.1:5000", tp_size=16)
    plan = launch_plan(config, index=0, model_path="/m", routed_experts=False, pick_port=ports())
    commands = other_node_commands(plan, config)
    assert [c[c.index("--node-rank") + 1] for c in commands] == ["1", "2"]
    assert all(c[c.index("--dist-init-addr") + 1] == "10.0.0.1:5000" for c in commands)


@pytest.mark.parametrize(("section", "message"), [
    ({"extra_args": ["--tp-size", "2"]}, "set by typed keys"),
    ({"extra_args": ["--skip-tokenizer-init"]}, "set by typed keys"),
    ({"nnodes": 2}, "needs dist_init_addr"),
    ({"enable_dp_attention": True}, "needs dp_size > 1"),
    ({"disaggregation": "both"}, r"Invalid enum value .both. - at `\$.inference.sglang.disaggregation`"),
])
def test_a_bad_sglang_section_is_a_config_error_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"inference.backend": "sglang",
                               **{f"inference.sglang.{key}": value for key, value in section.items()}})


def test_the_sglang_backend_loads_from_toml_and_refuses_decode_loans(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[inference]\nbackend = "sglang"\n[inference.sglang]\nurls = ["http://h:1"]\n'
                    'tp_size = 4\nspeculative_algorithm = "EAGLE"\n')
    config = load_config(path)
    assert (config.inference.backend, config.inference.sglang.tp_size) == ("sglang", 4)
    assert load_config().inference.backend == "local"  # the default stays the torch engine
    with pytest.raises(ConfigError, match="decode_loans needs inference.backend = 'local'"):
        load_config(path, overrides={"scheduler.decode_loans": 1})


# -- weights as a directory SGLang loads ----------------------------------------------------


def test_published_weights_become_a_model_directory_with_the_checkpoints_own_names(demo_model_dir, tmp_path):
    state = {name: tensor + 1 for name, tensor in load_hf_model(demo_model_dir).state_dict().items()}
    out = write_hf_weights(state, model_dir=demo_model_dir, out_root=tmp_path, version=3)

    assert out == tmp_path / "v3"
    with safe_open(str(out / "model.safetensors"), "pt") as written:
        names = set(written.keys())
        torch.testing.assert_close(written.get_tensor(next(iter(sorted(names)))), state[sorted(names)[0]])
    original = set()
    for file in demo_model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            original |= set(f.keys())
    assert original <= names  # every tensor SGLang's loader looks for, under its own name
    assert (out / "config.json").is_symlink() and (out / "config.json").resolve() == (demo_model_dir / "config.json").resolve()
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    for version in (4, 5):
        write_hf_weights(state, model_dir=demo_model_dir, out_root=tmp_path, version=version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v4", "v5"]  # the newest two are kept


@pytest_asyncio.fixture
async def fake():
    server = FakeSGLang()
    await server.start()
    yield server
    await server.stop()


async def test_a_published_version_is_loaded_by_sglang_paused_in_place_without_a_flush(fake, demo_model_dir, tmp_path):
    state = load_hf_model(demo_model_dir).state_dict()
    async with SGLangEngine([fake.url]) as engine:
        weights = SGLangDiskWeights(engine, model_dir=demo_model_dir, out_root=tmp_path)
        assert weights.stage_weights(state, 2)
        assert await weights.wait_weights_activated(2) == 2
        assert not weights.stage_weights(state, 1)  # older than what is served
        assert await engine.current_version() == 2
    assert [p for p, _ in fake.requests] == ["/pause_generation", "/update_weights_from_disk",
                                             "/continue_generation"]
    [update] = fake.bodies("/update_weights_from_disk")
    assert update == {"model_path": str(tmp_path / "v2"), "weight_version": "2", "flush_cache": False,
                      "abort_all_requests": False}
    assert msgspec.json.decode((tmp_path / "v2" / "config.json").read_bytes())["model_type"]


async def test_a_version_the_trainer_pushed_is_adopted_without_files_and_an_unpushed_one_is_loaded(
        fake, demo_model_dir, tmp_path):
    from support.fakes import RecordingPublisher
    from rollmesh.engine.weight_follower import WeightFollower
    from rollmesh.messages import WeightsPublished
    from rollmesh.messages.subjects import WEIGHTS_ACTIVATED

    bus = RecordingPublisher()
    async with SGLangEngine([fake.url]) as engine:
        weights = SGLangDiskWeights(engine, model_dir=demo_model_dir, out_root=tmp_path / "dirs",
                                    pushed_version=engine.current_version)
        follower = WeightFollower(weights, bus, worker="decode-0", role="decode")
        fake.label = "1"  # the trainer's push labels the servers once every bucket arrived
        await follower.handle_weights_published(WeightsPublished(
            version=1, path=str(tmp_path / "never-written" / "manifest.json"), sha256="0" * 64, num_bytes=1,
            trainer_step=1))
        assert weights.current_version == 1 and fake.bodies("/update_weights_from_disk") == []
        # A push that failed leaves the old label: the announced files are loaded instead.
        from rollmesh.engine.weight_buckets import write_buckets

        published = write_buckets(load_hf_model(demo_model_dir).state_dict(), tmp_path / "weights", version=2,
                                  bucket_bytes=1 << 30)
        await follower.handle_weights_published(WeightsPublished(
            version=2, path=str(published.manifest_path), sha256=published.manifest_sha256,
            num_bytes=published.total_bytes, trainer_step=2))
    assert [m.source for m in bus.messages(WEIGHTS_ACTIVATED)] == ["pushed", "files"]
    assert [m.version for m in bus.messages(WEIGHTS_ACTIVATED)] == [1, 2] and fake.label == "2"
