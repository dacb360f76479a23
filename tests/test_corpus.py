"""The real corpus (the standard library's own sources, as bytes) and its sharded loader."""

import os

import numpy as np
import pytest
import torch

from parcourse.corpus import ShardedLoader, build_corpus, is_validation, open_corpus, source_files


def test_the_corpus_is_deterministic_split_by_file_and_reused(tmp_path):
    a = build_corpus(tmp_path / "a", packages=["json", "email", "http", "string"], val_fraction=0.3)
    b = build_corpus(tmp_path / "b", packages=["json", "email", "http", "string"], val_fraction=0.3)
    assert a.meta["sha256"] == b.meta["sha256"] and a.meta["vocab"] == 256
    assert a.meta["files"]["val"] > 0 and a.meta["files"]["train"] > a.meta["files"]["val"]
    assert len(a.train) == a.meta["bytes"]["train"] and a.train.dtype == np.uint8
    files = source_files()  # the running interpreter's standard library
    assert len(files) > 100 and not any("site-packages" in f.parts for f in files)
    assert all(f.suffix == ".py" and "test" not in f.parts for f in files)
    # by path alone, the same on every machine: about the fraction asked, no file in both
    names = [f.name for f in files]
    share = sum(is_validation(n, 0.05) for n in names) / len(names)
    assert 0.02 < share < 0.1
    stamp = os.stat(tmp_path / "a" / "train.bin").st_mtime_ns
    again = build_corpus(
        tmp_path / "a", packages=["json", "email", "http", "string"], val_fraction=0.3
    )
    assert os.stat(tmp_path / "a" / "train.bin").st_mtime_ns == stamp  # reused, not rebuilt
    assert again.meta == a.meta


def test_a_half_built_corpus_is_not_taken_for_one(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"partial")  # a build killed before its meta.json
    with pytest.raises(ValueError, match="no corpus at"):
        open_corpus(tmp_path)
    corpus = build_corpus(tmp_path, packages=["json"])
    assert len(corpus.train) > 1000


def tokens(n=10_000):
    return np.frombuffer(bytes(range(256)) * (n // 256 + 1), dtype=np.uint8)[:n].copy()


def test_replicas_read_disjoint_rows_that_cover_each_global_batch():
    data = tokens()
    whole = ShardedLoader(data, 16, 7, seed=3)
    parts = [ShardedLoader(data, 16, 7, replica=r, replicas=3, seed=3) for r in range(3)]
    for _ in range(200):  # several epochs of 624 windows / 7
        x, y = whole.next()
        pieces = [p.next() for p in parts]
        assert [len(px) for px, _ in pieces] == [3, 2, 2]
        assert torch.equal(torch.cat([px for px, _ in pieces]), x)
        assert torch.equal(torch.cat([py for _, py in pieces]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets: the next byte
    assert whole.epoch > 1


def test_each_epoch_reads_every_window_once_in_a_new_order():
    """Windows told apart by their first token (the data counts up): within an epoch
    none twice, all but the few that do not fill a batch, and each epoch in an order of
    its own (a loader that never reshuffles reads the same order every epoch)."""
    data = np.arange(4_001, dtype=np.int64)
    loader = ShardedLoader(data, 40, 7, seed=2)  # 100 windows: 14 batches, 2 left out
    orders = []
    for _ in range(3):
        starts = [int(t) for _ in range(loader.batches_per_epoch) for t in loader.next()[0][:, 0]]
        assert len(set(starts)) == len(starts) == 98
        assert all(s % 40 == 0 for s in starts)
        orders.append(starts)
    assert orders[0] != orders[1] != orders[2] and orders[0] != orders[2]
    assert loader.epoch == 2


def test_a_save_at_the_very_end_of_an_epoch_resumes_into_the_next():
    data = np.arange(4_001, dtype=np.int64)
    run = ShardedLoader(data, 40, 7, replica=0, replicas=2, seed=2)
    for _ in range(run.batches_per_epoch):  # the epoch's last batch read, nothing more
        run.next()
    saved = run.state_dict()
    after = [run.next() for _ in range(3)]
    assert run.epoch == 1
    resumed = ShardedLoader(data, 40, 7, replica=0, replicas=2, seed=2)
    resumed.load_state_dict(saved)
    for (x, y), (rx, ry) in zip(after, [resumed.next() for _ in range(3)], strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_a_resumed_loader_reads_what_the_uninterrupted_one_reads():
    data = tokens(3_000)
    run = ShardedLoader(data, 32, 8, replica=1, replicas=2, seed=5)
    for _ in range(13):  # past an epoch boundary (93 windows: 11 batches an epoch)
        run.next()
    saved = run.state_dict()
    after = [run.next() for _ in range(20)]
    resumed = ShardedLoader(data, 32, 8, replica=1, replicas=2, seed=5)
    resumed.load_state_dict(saved)
    for (x, y), (rx, ry) in zip(after, [resumed.next() for _ in range(20)]):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with pytest.raises(ValueError, match="batch is 4, the saved one's 8"):
        ShardedLoader(data, 32, 4, seed=5).load_state_dict(saved)
    with pytest.raises(ValueError, match="cannot give each of 4 replicas a row"):
        ShardedLoader(data, 32, 3, replica=0, replicas=4)


def test_a_small_gpt_learns_the_standard_library(tmp_path):
    """Real text: 40 Adam steps of a tiny GPT on bytes of the json and email packages
    bring the validation loss well below a uniform guess over 256 bytes (ln 256 = 5.55)."""
    import torch.nn.functional as F

    from parcourse.models import GPTConfig, gpt

    corpus = build_corpus(tmp_path, packages=["json", "email"], val_fraction=0.2)
    config = GPTConfig(vocab=256, block_size=32, n_layers=2, n_heads=4, d_model=64)
    model = gpt(config)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    train = ShardedLoader(corpus.train, 32, 16, seed=0)
    val_x, val_y = ShardedLoader(corpus.val, 32, 64, seed=1).next()
    for _ in range(40):
        x, y = train.next()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        loss = F.cross_entropy(model(val_x).flatten(0, 1), val_y.flatten()).item()
    assert loss < 3.6, loss
