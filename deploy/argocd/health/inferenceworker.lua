-- Argo CD health of a sessionfleet.dev/v1alpha1 InferenceWorker, from the phase and
-- conditions the operator writes. Lua 5.1, the dialect of Argo CD's gopher-lua.
local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function explain(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  if c ~= nil and c.reason ~= nil then
    return c.reason
  end
  return fallback
end

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to start the worker"
  return hs
end

local generation = obj.metadata.generation
if status.observedGeneration ~= nil and generation ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to act on generation " .. generation
  return hs
end

local valid = condition(status, "Valid")
if valid ~= nil and valid.status == "False" then
  hs.status = "Degraded"
  hs.message = explain(valid, "The spec is invalid")
  return hs
end

local conflict = condition(status, "Conflict")
if conflict ~= nil and conflict.status == "True" then
  hs.status = "Degraded"
  hs.message = explain(conflict, "Several DrainPolicies select this worker")
  return hs
end

local phase = status.phase
local ready = condition(status, "Ready")
if phase == "Ready" then
  hs.status = "Healthy"
  hs.message = "Serving " .. (obj.spec.model or "its model") .. " (epoch " .. (status.epoch or 0) .. ")"
elseif phase == "Failed" then
  hs.status = "Degraded"
  hs.message = explain(ready, "The worker cannot run")
elseif phase == "Drained" and obj.spec.drain == true then
  -- Drained on request: nothing runs until spec.drain is false again.
  hs.status = "Suspended"
  hs.message = "Drained on request (spec.drain is true)"
elseif phase == "Draining" or phase == "Drained" then
  hs.status = "Progressing"
  hs.message = explain(condition(status, "Draining"), "Draining")
elseif phase == "Recovering" then
  hs.status = "Progressing"
  hs.message = explain(condition(status, "Recovering"), "Replacing the worker's pod")
elseif phase == "Pending" or phase == "Starting" then
  hs.status = "Progressing"
  hs.message = explain(ready, phase)
else
  hs.status = "Unknown"
  hs.message = "Unknown phase " .. phase
end
return hs
