"""KV cache layouts (LBHNC layer-major vs BLHNC block-major) and the NIXL transfer-descriptor planner."""

from kernels.kv_layout.layout import LAYOUTS, KVRegion, check_layout, regions_per_block
from kernels.kv_layout.planner import TransferPlan, plan_transfer, scattered_descriptor_count, scattered_placement

__all__ = ["LAYOUTS", "KVRegion", "TransferPlan", "check_layout", "plan_transfer", "regions_per_block",
           "scattered_descriptor_count", "scattered_placement"]
