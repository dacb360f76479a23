"""ipywidgets panels that launch real runs and draw what happened.

Installed as `parcourse.widgets`. The library (`parcourse`) never imports this.
"""

from parcourse.widgets.calculator import MemoryCalculator
from parcourse.widgets.panel import RunPanel
from parcourse.widgets.planner import PlannerPanel

from parcourse.launch.shared import close_shared_pools, shared_pool

__all__ = ["MemoryCalculator", "PlannerPanel", "RunPanel", "close_shared_pools", "shared_pool"]
