"""The engine core: LLMEngine orchestrates a step over the scheduler, block manager, input and output processors."""
