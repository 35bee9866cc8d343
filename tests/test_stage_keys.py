"""Stage keys from the current config layout, and run folders whose manifests hold the keys of
before ``manifests.KEY_VERSION`` 2: recognized and rekeyed, not redone."""

import json

from flows import manifests
from flows.migrate import old_stage_keys
from flows.pretrain import EVAL_BATCHES, NAMES, resolve, stage_keys
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
