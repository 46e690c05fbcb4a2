"""The recipe: schema, loading with overrides, validation."""

from llmft.recipe.load import RecipeError, load_recipe, to_container, to_yaml
from llmft.recipe.schema import Recipe

__all__ = ["Recipe", "RecipeError", "load_recipe", "to_container", "to_yaml"]
