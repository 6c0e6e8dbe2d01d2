"""The API's list of builtin models must be exactly what the runtime resolves: buildable recipes and packaged
checkpoints."""

from specrl.runtime.api import BUILTIN_MODELS
from specrl.runtime.models.hub import PACKAGED
from specrl.runtime.models.recipes import BUILTIN_RECIPES


def test_api_builtins_are_the_buildable_recipes_and_packaged_checkpoints() -> None:
    assert set(BUILTIN_MODELS) == {f"builtin:{name}" for name in (*BUILTIN_RECIPES, *PACKAGED)}
