"""The Lightning glue: the plugins and bases the tiered strategies hand to Lightning."""
