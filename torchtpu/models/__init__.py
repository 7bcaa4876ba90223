"""Per-model glue: parallelize plans and flavors. Model code comes from torchtitan."""
