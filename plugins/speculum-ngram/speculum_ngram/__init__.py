"""Prompt-lookup (n-gram) speculation: a speculum plugin."""

from speculum_ngram.proposer import (NgramOptions, NgramProposer, SuffixIndex, TreeSuffixIndex, continuation_trie,
                                     find_ngram_draft)

__all__ = ["NgramProposer", "NgramOptions", "find_ngram_draft", "SuffixIndex", "TreeSuffixIndex", "continuation_trie"]
