"""The step-cost models, re-exported from their home below the engine (conveyor/scheduler/costs.py):
the engine uses them too, and the simulator sits above the engine."""

from conveyor.scheduler.costs import (AfterPrefill, CostModel, StepCostModel, StepShape, hat_weights, preemption_costs,
                                      with_preemption_costs)

__all__ = ["AfterPrefill", "CostModel", "StepCostModel", "StepShape", "hat_weights", "preemption_costs", "with_preemption_costs"]
