"""Every record and compare option: parsed, validated once, and what it selects or tolerates."""
