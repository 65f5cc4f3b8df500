"""Write the trained models mxlib ships (``mxlib/models/trained/<recipe>/``) and record their accuracy.

``python tools/ship_trained.py [--cache DIR] [RECIPE ...]`` (default: every ``RECIPES`` entry): each recipe is
trained by ``mxlib.models.training.train_fp32`` (or taken from the training cache ``DIR``, where an earlier
``train`` call of the same recipe, torch and transformers left it), cast to bf16 and written with
``write_shipped``; its bf16 exact match and answer NLL per token on the notebooks' held-out prompts
(``eval_prompts`` 400 per task, seed 0, 1000 bootstrap resamples: notebook 06's defaults) go into its manifest.
"""

from __future__ import annotations

import argparse
import tempfile

from mxlib.models import evaluation as ev
from mxlib.models.tasks import make_dataset
from mxlib.models.training import RECIPES, get_recipe, train, write_shipped

EVAL_PROMPTS, SEED = 400, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("recipes", nargs="*", default=list(RECIPES))
    ap.add_argument("--cache", default=None, help="the training cache (default: a temporary folder: trains anew)")
    args = ap.parse_args()
    for name in args.recipes:
        recipe = get_recipe(name)
        with tempfile.TemporaryDirectory() as tmp:
            model = train(recipe, args.cache or tmp, retrain=True)
        sets = [make_dataset(t, EVAL_PROMPTS, SEED, "heldout") for t in recipe.tasks]
        results = ev.evaluate(model, sets, seed=SEED)
        accuracy = dict(
            eval_prompts=EVAL_PROMPTS,
            seed=SEED,
            tasks={
                t: {
                    m: dict(estimate=v.estimate, low=v.low, high=v.high)
                    for m, v in (("exact_match", r.exact_match), ("nll_per_token", r.nll_per_token))
                }
                for t, r in results.tasks.items()
            },
        )
        entry = write_shipped(model, recipe, name, accuracy)
        print(name, entry, {t: round(a["exact_match"]["estimate"], 4) for t, a in accuracy["tasks"].items()})


if __name__ == "__main__":
    main()
