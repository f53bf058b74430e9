"""--memory-snapshot (training/memory_snapshot.py) records the CUDA caching allocator: refused on another device. The
snapshots themselves are checked on a GPU, in tests/test_cuda.py."""


def test_memory_snapshot_is_refused_without_a_cuda_device(cli, tmp_path):
    """The suite hides GPUs (conftest.py): the default device is the CPU, and so is an explicit --device cpu."""
    for device in ([], ["--device", "cpu"]):
        code, _, err = cli("train", "--tp", "2", "--memory-snapshot", "--out-dir", str(tmp_path), *device)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "--memory-snapshot records the CUDA caching allocator: it needs a CUDA device, and this run's is cpu" \
            in err
