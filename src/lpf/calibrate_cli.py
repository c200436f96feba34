"""The `--calibrate` step of `lpf rescore` and `lpf audit`: run `pipeline.calibrate_run` under a
progress bar and say in one line what the floor will come from. Kept out of cli.py so the command
table there stays thin.
"""

from __future__ import annotations


def calibrate_step(run, token_budget: int, progress_bar, console) -> dict:
    from lpf.pipeline import calibrate_run

    with progress_bar("calibrate", "tokens") as (on_start, tick):
        cal = calibrate_run(run, token_budget, on_start, tick)
    if cal.get("same_as_reference"):
        console.print(f"calibration: the engine computed in {cal['dtype']} like the reference, so the reference "
                      f"against itself is the calibration run: floor 0, default thresholds", highlight=False)
    else:
        console.print(f"calibration: reference at the engine's {cal['dtype']} in {run.path}/calibration "
                      f"(noise floor from it, not from the engine)", highlight=False)
    return cal
