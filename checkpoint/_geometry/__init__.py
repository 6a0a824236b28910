"""Geometry of saved data: boxes of tensors, whether boxes tile a tensor, the reads that fill a
box from saved boxes, and who writes each box. Arithmetic only: no file, no storage.
"""

from ._boxes import Box, LocalBox, boxes_for, layout_of, local_boxes
from ._owners import assign_writers, is_local_candidate
from ._plan import ReadItem, covered_numel, plan_reads, split
from ._tiling import CORNER_PRIME, corner_digest, distinct_boxes, saved_tiling_problem, tiling_problem

__all__ = ["CORNER_PRIME", "Box", "LocalBox", "ReadItem", "assign_writers", "boxes_for", "corner_digest", "covered_numel", "distinct_boxes",
           "is_local_candidate", "layout_of", "local_boxes", "plan_reads", "saved_tiling_problem", "split",
           "tiling_problem"]
