"""Names that differ across the torch versions parcourse accepts (pyproject: >=2.6,<2.14).

Import these from here rather than from torch. torch 2.13 renamed two collectives (same
signatures, old names deprecated); use whichever exists.
"""

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
