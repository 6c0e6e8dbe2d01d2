"""The API's list of builtin models must be exactly the recipes the runtime can build."""

from specrl.runtime.api import BUILTIN_MODELS
from specrl.runtime.models.recipes import BUILTIN_RECIPES


def test_api_builtins_are_the_buildable_recipes() -> None:
    assert set(BUILTIN_MODELS) == {f"builtin:{name}" for name in BUILTIN_RECIPES}
