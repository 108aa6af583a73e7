"""gradlog's TensorBoard tab. `plugin.GradlogPlugin` is what TensorBoard loads (it imports tensorboard);
`data` builds what the tab shows from plain series, without TensorBoard."""
