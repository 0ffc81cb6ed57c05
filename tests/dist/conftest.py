import pytest


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    """The shared 4-rank launch (tests/dist/_four_ranks.py): {"rows": parquet path, "train": ..., "memory": ...}."""
    from tests.dist._four_ranks import launch

    return launch(tmp_path_factory.mktemp("four_ranks"))
