"""What every layer and every command may import: user errors, their one-line exit, checked config fields."""
