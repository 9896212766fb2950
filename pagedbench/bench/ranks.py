"""The kernels and check grids spread over the ranks torchrun started (one GPU each on CUDA):
rank r measures items r, r + world, ...; rank 0 gathers every rank's rows and orders them as the
grid does, so its table is the one a single process would write. The group joined here is left
after the gather: a rank that exits with a live gloo group can abort ("terminate called without an
active exception") while rank 0 is still writing the reports."""

import os

import torch
import torch.distributed as dist

_joined: list = []  # the group grid_world joined, left after the gather


def grid_world() -> tuple[int, int]:
    """(rank, world size) under torchrun (WORLD_SIZE > 1), joining its gloo group once (rows travel
    as Python objects) and taking the local GPU as the current device; (0, 1) otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        _joined.append(dist.group.WORLD)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return dist.get_rank(), dist.get_world_size()


def reporting_rank() -> bool:
    """Whether this process prints and writes reports: the only one, or rank 0 of a launch."""
    return os.environ.get("RANK", "0") == "0"


def gather_rows(mine: dict[int, list[dict]]) -> list[dict] | None:
    """Rank 0: every rank's rows (by grid item index), in grid order; other ranks: None."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if _joined:
        dist.destroy_process_group(_joined.pop())
    if parts is None:
        return None
    merged = {index: rows for part in parts for index, rows in part.items()}
    return [row for index in sorted(merged) for row in merged[index]]
