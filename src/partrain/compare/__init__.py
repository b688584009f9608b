"""``partrain compare``: measure the strategies on the user's own model, recommend one, predict scaling.

- `compare` (`run.py`) runs each applicable strategy for a window sized from the budget,
  through `partrain.fit` (`measure.py`), with hooks on the model for steady-state timing,
  memory and an injected straggler (`probe.py`); `plan.py` sizes each window from the budget
  (`WindowPlanner`) and each run-off round;
- `recommend` (`decide.py`) turns the measurements, and a what-if link, into advice;
- `partrain.scaling` holds the communication model the prediction fits;
- `report.py` prints the table and writes compare.json, compare.csv and compare.png.
"""

from .decide import Recommendation, recommend
from .measure import Candidate, Measurement
from .options import Straggler
from .run import CANDIDATES, CompareResult, compare

__all__ = ["CANDIDATES", "Candidate", "CompareResult", "Measurement", "Recommendation", "Straggler", "compare",
           "recommend"]
