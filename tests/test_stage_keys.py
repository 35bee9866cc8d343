"""Stage keys from the current config layout, and run folders whose manifests hold the keys of
before ``manifests.KEY_VERSION`` 2: recognized and rekeyed, not redone."""

import json
from dataclasses import replace

from flows import manifests
from flows.layout import resolve
from flows.migrate import old_stage_keys
from flows.pretrain import EVAL_BATCHES, NAMES, stage_keys
from moe_core.compose import compose_dict


def test_an_old_manifest_holding_the_old_key_of_this_config_verifies_and_is_rekeyed(tmp_path):
    run = resolve(compose_dict([], config_name="pretrain-tiny"), tmp_path)
    keys, old = stage_keys(run), old_stage_keys(run, EVAL_BATCHES)
    assert keys["train"] != old["train"] and list(keys) == list(NAMES)
    (tmp_path / "out.txt").write_text("x")
    files = manifests.checksums(tmp_path, [tmp_path / "out.txt"])
    record = {"stage": "train", "key": old["train"], "files": files, "summary": {}, "at": 1.0}
    path = manifests.manifest_path(tmp_path, "train")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))  # written the old way: no key_version
    assert manifests.verify(tmp_path, "train", keys["train"])[0] is None
    found, why = manifests.verify(tmp_path, "train", keys["train"], old["train"])
    assert why == "" and not manifests.current(found)
    manifests.rekey(tmp_path, "train", found, keys["train"])
    again = manifests.read(tmp_path, "train")
    assert again["key"] == keys["train"] and manifests.current(again) and again["at"] == 1.0
    assert manifests.verify(tmp_path, "train", keys["train"], old["train"])[1] == ""
    # a rekeyed (current) manifest no longer answers to its old key
    assert manifests.verify(tmp_path, "train", "another", old["train"])[0] is None


# ModelConfig's fields when key version 2 was set: an option added since hashes only when set
# otherwise than before (manifests.ADDED_SINCE), so existing run folders keep their keys.
MODEL_FIELDS_AT_V2 = {
    "name", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "n_experts", "top_k",
    "expert_hidden", "n_shared_experts", "max_seq_len", "rope_theta", "norm_eps", "router",
    "normalize_top_k", "aux_loss_coef", "z_loss_coef", "expert_bias", "expert_bias_rate",
    "init_std",
}  # fmt: skip


def test_options_added_since_key_version_2_leave_existing_keys_alone(tmp_path):
    from moe_core.config_dict import to_dict

    run = resolve(compose_dict([], config_name="pretrain-tiny"), tmp_path)
    # the router losses' mean over layers became the default after version 2: a default
    # config now trains another objective, so its key names the choice; the old one does not
    keyed = set(manifests.keyed("model", to_dict(run.model)))
    assert keyed == MODEL_FIELDS_AT_V2 | {"aux_loss_reduction"}
    run = replace(run, model=replace(run.model, aux_loss_reduction="sum"))
    assert set(manifests.keyed("model", to_dict(run.model))) == MODEL_FIELDS_AT_V2
    before = stage_keys(run)
    changed = replace(run, model=replace(run.model, qk_norm="head"))
    after = stage_keys(changed)
    assert after["tokenize"] == before["tokenize"] and after["init"] != before["init"]
    # head_dim is "as before" when it is d_model / n_heads, whether given or not
    same = replace(run, model=replace(run.model, head_dim=run.model.d_model // run.model.n_heads))
    assert stage_keys(same) == before


def test_data_options_added_since_key_version_2_leave_the_tokenize_key_alone(tmp_path):
    """``data.format`` and ``data.token_dtype`` (corpora of other tools, read in place) and
    ``data.sources`` (mixtures; empty: the one folder) hash only when set, and where the work
    runs (``data.scheduler``, ``data.unit_documents``) never, since the shards do not depend on
    it: a run folder tokenized before them keeps its tokenize key."""
    from moe_core.config_dict import to_dict

    run = resolve(compose_dict([], config_name="pretrain-tiny"), tmp_path)
    new = {"dir", "format", "token_dtype", "sources", "scheduler", "unit_documents"}
    data = {k: v for k, v in to_dict(run.data).items() if k not in new}
    assert stage_keys(run)["tokenize"] == manifests.digest(
        {"data": data, "vocab": run.model.vocab_size}
    )
    here = replace(run.data, workers=0)
    elsewhere = replace(here, scheduler="tcp://10.0.0.1:8786", unit_documents=7)
    assert stage_keys(replace(run, data=elsewhere)) == stage_keys(replace(run, data=here))


def test_train_options_added_since_key_version_2_leave_the_train_key_alone(tmp_path):
    """``train.document_mask``, ``parallel.cp`` and ``parallel.backend`` hash only when set
    otherwise than before (they change what or how training computes), the hang watchdog's
    limits and flight recorder and the straggler report's never: a run folder trained before
    them keeps its train key."""
    from moe_core.config_dict import to_dict

    run = resolve(compose_dict([], config_name="pretrain-tiny"), tmp_path)
    added = {"document_mask", "hang_factor", "hang_min_s", "hang_first_s", "cp", "backend"}
    added |= {"straggler_share", "straggler_windows", "flight_recorder"}
    train = {k: v for k, v in to_dict(run.train).items() if k not in added}
    parallel = {k: v for k, v in to_dict(run.parallel).items() if k not in added}
    keys = stage_keys(run)
    assert keys["train"] == manifests.digest(
        {
            "model": manifests.keyed("model", to_dict(run.model)),
            "train": train,
            "parallel": parallel,
            "precision": manifests.precision_section(to_dict(run.precision)),
            "tokenize": keys["tokenize"],
            "init": keys["init"],
        }
    )
    patient = replace(run, train=replace(run.train, hang_factor=20.0, hang_min_s=900.0))
    assert stage_keys(patient) == keys
    tolerant = replace(run, train=replace(run.train, straggler_share=0.5, straggler_windows=9))
    assert stage_keys(tolerant) == keys
    # FP8 weights quantized once per step or in every call: the same bytes, the same run
    fp8 = replace(run, precision=replace(run.precision, params="bf16", compute="bf16"))
    fp8 = replace(fp8, precision=replace(fp8.precision, fp8_parts=["experts"]))
    cached = replace(fp8, precision=replace(fp8.precision, fp8_weight_cache=True))
    assert stage_keys(cached) == stage_keys(fp8)
    masked = replace(run, train=replace(run.train, document_mask=True))
    assert stage_keys(masked)["train"] != keys["train"]
    # Whether a relaunch on fewer nodes waits or shrinks is the cluster's (no key hashes it):
    # the run it trains is the same.
    four = replace(
        run,
        train=replace(run.train, micro_batch_size=4),
        parallel=replace(run.parallel, dp=2),
        cluster=replace(run.cluster, kind="slurm", nodes=2, procs_per_node=2),
    )
    shrinking = replace(four, cluster=replace(four.cluster, on_node_loss="shrink", min_nodes=1))
    assert shrinking.node_counts == {2: 2, 1: 1}
    assert stage_keys(shrinking) == stage_keys(four)


def test_the_pipeline_refuses_a_corpus_of_another_format_before_anything_runs(tmp_path):
    import pytest

    from moe_core.config import ConfigError

    config = compose_dict(["data=dolma", "data.dir=/corpus"], config_name="pretrain-tiny")
    with pytest.raises(ConfigError, match=r"data\.format='dolma' is not allowed for the pipeline"):
        resolve(config, tmp_path)
    assert not any(tmp_path.iterdir())
